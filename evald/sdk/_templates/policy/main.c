/* A template evald policy (ABI v1, docs/abi.md): reads one JSON object, writes one JSON value.
 * {"age": 34, "components": [6500, 1200]} -> {"total":7700,"action":"book_appointment",
 * "reason":"eligible"}. evald_json.h (the SDK's JSON library) reads the input and writes the
 * value; manifest.json declares both as JSON Schemas, which `evald test` checks. */
#include "evald_json.h"

#define INPUT_CAPACITY 4096
#define OUTPUT_CAPACITY 256
#define EXPORT(name) __attribute__((export_name(name)))

static unsigned char input_buf[INPUT_CAPACITY];
static unsigned char output_buf[OUTPUT_CAPACITY];
static ej_token tokens[1024]; /* the parsed input: one token per value, key or member */

EXPORT("evald_abi_version") int evald_abi_version(void) { return 1; }
EXPORT("evald_input_ptr") int evald_input_ptr(void) { return (int)(long)input_buf; }
EXPORT("evald_input_cap") int evald_input_cap(void) { return INPUT_CAPACITY; }
EXPORT("evald_output_ptr") int evald_output_ptr(void) { return (int)(long)output_buf; }
EXPORT("evald_output_cap") int evald_output_cap(void) { return OUTPUT_CAPACITY; }

/* Writes CODE:message and returns minus its length (an error). */
static int fail(const char *code, const char *message) {
    int n = 0;
    while (*code) output_buf[n++] = (unsigned char)*code++;
    output_buf[n++] = ':';
    while (*message) output_buf[n++] = (unsigned char)*message++;
    return -n;
}

/* Returns the value's length, or minus the length of CODE:message (an error). */
EXPORT("evald_eval") int evald_eval(int input_len) {
    if (input_len < 0 || input_len > INPUT_CAPACITY) return fail("syntax", "input too long");
    ej_doc doc;
    int error = ej_parse(&doc, input_buf, input_len, tokens, 1024);
    if (error == EJ_TOO_MANY) return fail("too_large", ej_message(error));
    if (error != EJ_OK) return fail("syntax", ej_message(error));
    if (tokens[0].kind != EJ_OBJECT) return fail("syntax", "expected a JSON object");
    int age_at = ej_get(&doc, 0, "age"), has_age = 0;
    long long age = 0;
    if (age_at >= 0 && tokens[age_at].kind != EJ_NULL) {
        ej_decimal d;
        if (!ej_decimal_of(&doc, age_at, &d) || !ej_decimal_int(d, &age))
            return fail("syntax", "age must be an integer or null");
        has_age = 1;
    }
    ej_decimal total = {0, 0};
    int has_total = 0, list = ej_get(&doc, 0, "components");
    if (list >= 0 && tokens[list].kind == EJ_ARRAY) {
        for (int k = 0, at = list + 1; k < tokens[list].size; k++, at = tokens[at].next) {
            ej_decimal amount;
            if (!ej_decimal_of(&doc, at, &amount)) return fail("syntax", "bad component");
            if (!ej_decimal_add(total, amount, &total)) return fail("too_large", "total too large");
            has_total = 1;
        }
    } else if (list >= 0 && tokens[list].kind != EJ_NULL) {
        return fail("syntax", "components must be an array");
    }

    const ej_decimal limit = {10000, 0};
    const char *action = "book_appointment", *reason = "eligible";
    if (!has_age || !has_total) action = "escalate_human", reason = "insufficient_info";
    else if (age < 18) action = "decline", reason = "under_age";
    else if (ej_decimal_cmp(total, limit) > 0) action = "decline", reason = "over_limit";
    ej_writer out = ej_writer_init(output_buf, OUTPUT_CAPACITY);
    ej_begin_object(&out);
    ej_key(&out, "total");
    if (has_total) ej_decimal_write(&out, total);
    else ej_null(&out);
    ej_key(&out, "action");
    ej_string_z(&out, action);
    ej_key(&out, "reason");
    ej_string_z(&out, reason);
    ej_end_object(&out);
    int n = ej_finish(&out);
    return n < 0 ? fail("too_large", "the value does not fit") : n;
}
