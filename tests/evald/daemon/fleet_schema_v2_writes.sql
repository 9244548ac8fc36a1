-- The daemons' two functions as schema version 2's `evald store init` made them (without
-- the call's token hash), with their grant. test_fleet_revocation upgrades such a store.
CREATE OR REPLACE FUNCTION evald.register_evaluator(
    p_tenant text, p_name text, p_tag text, p_sha256 text, p_bytes bytea, p_manifest jsonb,
    p_replace boolean
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_revision bigint := evald.begin_change();
    v_tenant record;
    v_clash record;
    v_exists boolean;
    v_count integer;
BEGIN
    SELECT may_register, max_modules INTO v_tenant FROM evald.tenants WHERE name = p_tenant;
    IF NOT FOUND OR NOT v_tenant.may_register THEN
        RAISE EXCEPTION 'tenant % may not register evaluators in the fleet store (an operator '
            'runs `evald tenants limits % --may-register`)', quote_literal(p_tenant), p_tenant
            USING ERRCODE = 'EV403';
    END IF;
    IF encode(sha256(p_bytes), 'hex') IS DISTINCT FROM p_sha256 THEN
        RAISE EXCEPTION 'the module''s bytes do not match its hash %', left(p_sha256, 12)
            USING ERRCODE = 'EV400';
    END IF;
    SELECT name, tag INTO v_clash FROM evald.evaluators
        WHERE tenant = p_tenant AND sha256 IS NOT NULL AND name <> p_name
          AND (p_tag IN (name, tag) OR p_name = tag)
        LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'the manifest''s name % or tag % clashes with your evaluator % (tag %)',
            quote_literal(p_name), quote_literal(p_tag), quote_literal(v_clash.name),
            quote_literal(v_clash.tag) USING ERRCODE = 'EV400';
    END IF;
    SELECT count(*) FILTER (WHERE name = p_name) > 0, count(*) INTO v_exists, v_count
        FROM evald.evaluators WHERE tenant = p_tenant AND sha256 IS NOT NULL;
    IF v_exists AND NOT p_replace THEN
        RAISE EXCEPTION 'you already have an evaluator %; register with replace to update it '
            '(`evald register --replace`)', quote_literal(p_name) USING ERRCODE = 'EV400';
    END IF;
    IF NOT v_exists AND v_count >= v_tenant.max_modules THEN
        RAISE EXCEPTION 'tenant % already has % evaluators, its maximum (an operator raises it '
            'with `evald tenants limits --max-modules`)', quote_literal(p_tenant), v_count
            USING ERRCODE = 'EV400';
    END IF;
    INSERT INTO evald.modules (sha256, bytes, size) VALUES (p_sha256, p_bytes, length(p_bytes))
        ON CONFLICT (sha256) DO NOTHING;
    INSERT INTO evald.uploads (tenant, sha256) VALUES (p_tenant, p_sha256) ON CONFLICT DO NOTHING;
    INSERT INTO evald.evaluators (tenant, name, sha256, tag, manifest, revision)
        VALUES (p_tenant, p_name, p_sha256, p_tag, p_manifest, v_revision)
        ON CONFLICT (tenant, name) DO UPDATE SET sha256 = EXCLUDED.sha256,
            tag = EXCLUDED.tag, manifest = EXCLUDED.manifest;
    PERFORM evald.record_change(p_tenant,
        CASE WHEN v_exists THEN 'evaluator.replace' ELSE 'evaluator.register' END,
        p_tenant, p_name, p_sha256, jsonb_build_object('bytes', length(p_bytes)));
    RETURN v_revision;
END $$;

CREATE OR REPLACE FUNCTION evald.delete_evaluator(p_tenant text, p_name text) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_revision bigint := evald.begin_change();
BEGIN
    UPDATE evald.evaluators SET sha256 = NULL, tag = NULL, manifest = NULL
        WHERE tenant = p_tenant AND name = p_name AND sha256 IS NOT NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tenant % has no registered evaluator %', quote_literal(p_tenant),
            quote_literal(p_name) USING ERRCODE = 'EV404';
    END IF;
    PERFORM evald.record_change(p_tenant, 'evaluator.delete', p_tenant, p_name, NULL, NULL);
    RETURN v_revision;
END $$;
GRANT EXECUTE ON FUNCTION evald.register_evaluator(text, text, text, text, bytea, jsonb, boolean),
    evald.delete_evaluator(text, text) TO evald_daemon;
UPDATE evald.schema SET version = 2;
