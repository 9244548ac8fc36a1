/* evald_json.h: one JSON value in, one JSON value out, for a policy evaluator in C
 * (docs/writing-evaluators.md, "A policy"). Header-only, no libc, no allocator: `evald build`
 * puts it on every C guest's include path (#include "evald_json.h").
 *
 * The reader parses one JSON value (RFC 8259: objects, arrays, numbers, strings with every
 * escape, true, false, null; valid UTF-8, no lone surrogates) into an array of tokens the
 * guest provides, at most EJ_MAX_DEPTH arrays and objects deep; anything else is an error
 * whose ej_message() a guest returns as a `syntax` error. An object's members are a key token
 * (a string) followed by the value's tokens; every token knows where the next value starts.
 * Numbers keep their JSON text; ej_decimal_of() reads one exactly (no binary floating point:
 * 0.1 + 0.2 is 0.3).
 *
 * The writer writes one compact JSON value into a fixed buffer (the ABI's output buffer),
 * escaping strings as JSON does and writing `<` as \u003c, so a value never holds the `<`
 * the ABI forbids in a result. */
#ifndef EVALD_JSON_H
#define EVALD_JSON_H

#define EJ_MAX_DEPTH 32

typedef enum { EJ_NULL, EJ_BOOL, EJ_NUMBER, EJ_STRING, EJ_ARRAY, EJ_OBJECT } ej_kind;
enum { EJ_OK = 0, EJ_SYNTAX = -1, EJ_TOO_DEEP = -2, EJ_TOO_MANY = -3 };

typedef struct {
    ej_kind kind;
    int start, end; /* the value's text (a string's without its quotes) */
    int size;       /* items of an array, members of an object */
    int next;       /* the index of the token after this value and everything inside it */
} ej_token;

typedef struct {
    const unsigned char *text;
    int len, pos, count, cap;
    ej_token *tokens;
} ej_doc;

/* An exact decimal: units / 10^scale, in a 64-bit integer, scale 0..18. */
typedef struct {
    long long units;
    int scale;
} ej_decimal;

static const char *ej_message(int error) {
    if (error == EJ_TOO_DEEP) return "the input nests arrays and objects too deeply";
    if (error == EJ_TOO_MANY) return "the input holds more values than the evaluator has room for";
    return "the input is not one JSON value";
}

static int ej__utf8_valid(const unsigned char *s, int len) {
    for (int i = 0; i < len;) {
        unsigned c = s[i];
        int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
        if (n < 0 || i + n >= len) return 0;
        unsigned code = n == 0 ? c : c & (0x3f >> n);
        for (int k = 1; k <= n; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            code = (code << 6) | (s[i + k] & 0x3f);
        }
        if ((n == 1 && code < 0x80) || (n == 2 && code < 0x800) || (n == 3 && code < 0x10000) ||
            code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff))
            return 0;
        i += n + 1;
    }
    return 1;
}

static void ej__space(ej_doc *d) {
    while (d->pos < d->len && (d->text[d->pos] == ' ' || d->text[d->pos] == '\t' ||
                               d->text[d->pos] == '\n' || d->text[d->pos] == '\r'))
        d->pos++;
}

static int ej__hex4(ej_doc *d, unsigned *out) {
    if (d->pos + 4 > d->len) return 0;
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        unsigned char c = d->text[d->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return 0;
    }
    *out = v;
    return 1;
}

/* Checks a string at pos (its opening quote) and moves past it. */
static int ej__string(ej_doc *d) {
    d->pos++;
    while (d->pos < d->len) {
        unsigned char c = d->text[d->pos++];
        if (c == '"') return 1;
        if (c < 0x20) return 0;
        if (c != '\\') continue;
        if (d->pos >= d->len) return 0;
        c = d->text[d->pos++];
        if (c == 'u') {
            unsigned code, low;
            if (!ej__hex4(d, &code) || (code >= 0xdc00 && code <= 0xdfff)) return 0;
            if (code >= 0xd800 && code <= 0xdbff) {
                if (d->pos + 2 > d->len || d->text[d->pos] != '\\' || d->text[d->pos + 1] != 'u')
                    return 0;
                d->pos += 2;
                if (!ej__hex4(d, &low) || low < 0xdc00 || low > 0xdfff) return 0;
            }
        } else if (c != '"' && c != '\\' && c != '/' && c != 'b' && c != 'f' && c != 'n' &&
                   c != 'r' && c != 't') {
            return 0;
        }
    }
    return 0;
}

static int ej__digits(ej_doc *d) {
    int start = d->pos;
    while (d->pos < d->len && d->text[d->pos] >= '0' && d->text[d->pos] <= '9') d->pos++;
    return d->pos - start;
}

static int ej__number(ej_doc *d) {
    if (d->pos < d->len && d->text[d->pos] == '-') d->pos++;
    if (d->pos < d->len && d->text[d->pos] == '0') d->pos++;
    else if (!ej__digits(d)) return 0;
    if (d->pos < d->len && d->text[d->pos] == '.') {
        d->pos++;
        if (!ej__digits(d)) return 0;
    }
    if (d->pos < d->len && (d->text[d->pos] == 'e' || d->text[d->pos] == 'E')) {
        d->pos++;
        if (d->pos < d->len && (d->text[d->pos] == '+' || d->text[d->pos] == '-')) d->pos++;
        if (!ej__digits(d)) return 0;
    }
    return 1;
}

static int ej__word(ej_doc *d, const char *word) {
    for (; *word; word++, d->pos++)
        if (d->pos >= d->len || d->text[d->pos] != (unsigned char)*word) return 0;
    return 1;
}

static int ej__value(ej_doc *d, int depth) {
    ej__space(d);
    if (d->pos >= d->len) return EJ_SYNTAX;
    if (d->count >= d->cap) return EJ_TOO_MANY;
    int index = d->count++;
    ej_token *t = &d->tokens[index];
    unsigned char c = d->text[d->pos];
    t->start = d->pos;
    t->size = 0;
    if (c == '{' || c == '[') {
        if (depth >= EJ_MAX_DEPTH) return EJ_TOO_DEEP;
        unsigned char close = c == '{' ? '}' : ']';
        t->kind = c == '{' ? EJ_OBJECT : EJ_ARRAY;
        d->pos++;
        ej__space(d);
        if (d->pos < d->len && d->text[d->pos] == close) {
            d->pos++;
        } else {
            for (;;) {
                if (t->kind == EJ_OBJECT) {
                    ej__space(d);
                    if (d->pos >= d->len || d->text[d->pos] != '"') return EJ_SYNTAX;
                    int key = ej__value(d, depth + 1);
                    if (key != EJ_OK) return key;
                    ej__space(d);
                    if (d->pos >= d->len || d->text[d->pos++] != ':') return EJ_SYNTAX;
                }
                int error = ej__value(d, depth + 1);
                if (error != EJ_OK) return error;
                d->tokens[index].size++;
                ej__space(d);
                if (d->pos >= d->len) return EJ_SYNTAX;
                unsigned char next = d->text[d->pos++];
                if (next == close) break;
                if (next != ',') return EJ_SYNTAX;
            }
        }
        t = &d->tokens[index];
    } else if (c == '"') {
        t->kind = EJ_STRING;
        if (!ej__string(d)) return EJ_SYNTAX;
        t->start += 1;
        t->end = d->pos - 1;
        t->next = d->count;
        return EJ_OK;
    } else if (c == 't' || c == 'f') {
        t->kind = EJ_BOOL;
        if (!ej__word(d, c == 't' ? "true" : "false")) return EJ_SYNTAX;
    } else if (c == 'n') {
        t->kind = EJ_NULL;
        if (!ej__word(d, "null")) return EJ_SYNTAX;
    } else {
        t->kind = EJ_NUMBER;
        if (!ej__number(d)) return EJ_SYNTAX;
    }
    t->end = d->pos;
    t->next = d->count;
    return EJ_OK;
}

/* Parses exactly one JSON value of text[0..len) into tokens[0..cap): EJ_OK, or an error for
 * ej_message(). The root is token 0. */
static int ej_parse(ej_doc *d, const unsigned char *text, int len, ej_token *tokens, int cap) {
    d->text = text;
    d->len = len;
    d->pos = 0;
    d->count = 0;
    d->cap = cap;
    d->tokens = tokens;
    if (!ej__utf8_valid(text, len)) return EJ_SYNTAX;
    int error = ej__value(d, 0);
    if (error != EJ_OK) return error;
    ej__space(d);
    return d->pos == d->len ? EJ_OK : EJ_SYNTAX;
}

/* Decodes a string token into out[0..cap) (UTF-8); its length, or -1 when it does not fit. */
static int ej_string(const ej_doc *d, int token, char *out, int cap) {
    const ej_token *t = &d->tokens[token];
    int n = 0;
    for (int i = t->start; i < t->end;) {
        unsigned code = d->text[i++];
        if (code == '\\') {
            unsigned char e = d->text[i++];
            code = e == 'b' ? 8 : e == 'f' ? 12 : e == 'n' ? 10 : e == 'r' ? 13 : e == 't' ? 9 : e;
            if (e == 'u') {
                ej_doc at = *d;
                at.pos = i;
                ej__hex4(&at, &code);
                if (code >= 0xd800 && code <= 0xdbff) {
                    unsigned low;
                    at.pos += 2;
                    ej__hex4(&at, &low);
                    code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
                }
                i = at.pos;
                unsigned char bytes[4];
                int k = code < 0x80 ? 1 : code < 0x800 ? 2 : code < 0x10000 ? 3 : 4;
                if (k == 1) bytes[0] = (unsigned char)code;
                else {
                    for (int j = k - 1; j > 0; j--, code >>= 6) bytes[j] = 0x80 | (code & 0x3f);
                    bytes[0] = (unsigned char)((0xf00 >> k) | code);
                }
                if (n + k > cap) return -1;
                for (int j = 0; j < k; j++) out[n++] = (char)bytes[j];
                continue;
            }
        }
        if (n >= cap) return -1;
        out[n++] = (char)code;
    }
    return n;
}

/* The value of an object's member `key` (the last of that key), or -1. */
static int ej_get(const ej_doc *d, int object, const char *key) {
    if (d->tokens[object].kind != EJ_OBJECT) return -1;
    int found = -1;
    char name[256];
    for (int i = object + 1, m = 0; m < d->tokens[object].size; m++) {
        int n = ej_string(d, i, name, sizeof name), k = 0;
        while (k < n && key[k] && name[k] == key[k]) k++;
        if (n >= 0 && k == n && !key[k]) found = i + 1;
        i = d->tokens[i + 1].next;
    }
    return found;
}

/* Reads a number token exactly: 1, or 0 beyond the range (more than 18 significant digits,
 * an exponent beyond 1000, or a value whose units or scale leave the range). */
static int ej_decimal_of(const ej_doc *d, int token, ej_decimal *out) {
    const ej_token *t = &d->tokens[token];
    if (t->kind != EJ_NUMBER) return 0;
    int i = t->start, negative = d->text[i] == '-', digits = 0, fraction = 0, scale = 0;
    long long units = 0;
    if (negative) i++;
    for (; i < t->end; i++) {
        unsigned char c = d->text[i];
        if (c == '.') fraction = 1;
        else if (c >= '0' && c <= '9') {
            if (digits > 0 || c != '0') digits++;
            if (digits > 18) return 0;
            units = units * 10 + (c - '0');
            scale += fraction;
        } else break;
    }
    if (i < t->end) {
        int sign = -1, exponent = 0; /* 1e5 lowers the scale by 5, 1e-5 raises it */
        i++;
        if (d->text[i] == '+' || d->text[i] == '-') sign = d->text[i++] == '-' ? 1 : -1;
        for (; i < t->end; i++) {
            exponent = exponent * 10 + (d->text[i] - '0');
            if (exponent > 1000) return 0;
        }
        scale += sign * exponent;
    }
    for (; scale < 0; scale++)
        if (__builtin_mul_overflow(units, 10LL, &units)) return 0;
    for (; scale > 18 && units % 10 == 0; scale--) units /= 10;
    if (scale > 18) return 0;
    out->units = negative ? -units : units;
    out->scale = scale;
    return 1;
}

static int ej__rescale(ej_decimal d, int scale, long long *out) {
    long long units = d.units;
    for (int s = d.scale; s < scale; s++)
        if (__builtin_mul_overflow(units, 10LL, &units)) return 0;
    *out = units;
    return 1;
}

/* a + b into *out: 1, or 0 when the sum leaves the range. */
static int ej_decimal_add(ej_decimal a, ej_decimal b, ej_decimal *out) {
    int scale = a.scale > b.scale ? a.scale : b.scale;
    long long x, y;
    if (!ej__rescale(a, scale, &x) || !ej__rescale(b, scale, &y)) return 0;
    if (__builtin_add_overflow(x, y, &out->units)) return 0;
    out->scale = scale;
    return 1;
}

/* -1, 0 or 1 as a is below, equal to or above b. */
static int ej_decimal_cmp(ej_decimal a, ej_decimal b) {
    long long ta = 1, tb = 1;
    for (int s = 0; s < a.scale; s++) ta *= 10;
    for (int s = 0; s < b.scale; s++) tb *= 10;
    long long ia = a.units / ta, ib = b.units / tb; /* whole parts, then fractions */
    if (ia != ib) return ia < ib ? -1 : 1;
    long long fa = a.units % ta, fb = b.units % tb; /* below 10^18 at either scale */
    for (int s = a.scale; s < b.scale; s++) fa *= 10;
    for (int s = b.scale; s < a.scale; s++) fb *= 10;
    return fa < fb ? -1 : fa > fb;
}

/* A decimal with no fractional part as an integer: 1, or 0 when it has one. */
static int ej_decimal_int(ej_decimal d, long long *out) {
    long long ten = 1;
    for (int s = 0; s < d.scale; s++) ten *= 10;
    if (d.units % ten != 0) return 0;
    *out = d.units / ten;
    return 1;
}

/* The writer: call the functions in document order; ej_finish gives the length, or -1 when
 * the value did not fit (a guest's too_large). */
typedef struct {
    unsigned char *buf;
    int cap, len, overflow, depth, after_key;
    unsigned long long filled; /* bit d: the container at depth d already holds an item */
} ej_writer;

static ej_writer ej_writer_init(unsigned char *buf, int cap) {
    ej_writer w = {buf, cap, 0, 0, 0, 0, 0};
    return w;
}

static void ej__raw(ej_writer *w, const char *text, int n) {
    if (w->overflow || w->len + n > w->cap) {
        w->overflow = 1;
        return;
    }
    for (int i = 0; i < n; i++) w->buf[w->len++] = (unsigned char)text[i];
}

static void ej__item(ej_writer *w) {
    if (w->after_key) {
        w->after_key = 0;
        return;
    }
    if (w->filled & (1ULL << w->depth)) ej__raw(w, ",", 1);
    w->filled |= 1ULL << w->depth;
}

static void ej__open(ej_writer *w, const char *bracket) {
    ej__item(w);
    ej__raw(w, bracket, 1);
    w->depth++;
    w->filled &= ~(1ULL << w->depth);
}

static void ej_begin_object(ej_writer *w) { ej__open(w, "{"); }
static void ej_begin_array(ej_writer *w) { ej__open(w, "["); }
static void ej_end_object(ej_writer *w) { w->depth--, ej__raw(w, "}", 1); }
static void ej_end_array(ej_writer *w) { w->depth--, ej__raw(w, "]", 1); }

static void ej__quoted(ej_writer *w, const char *text, int n) {
    static const char hex[] = "0123456789abcdef";
    ej__raw(w, "\"", 1);
    for (int i = 0; i < n; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c == '"') ej__raw(w, "\\\"", 2);
        else if (c == '\\') ej__raw(w, "\\\\", 2);
        else if (c == '\n') ej__raw(w, "\\n", 2);
        else if (c == '\r') ej__raw(w, "\\r", 2);
        else if (c == '\t') ej__raw(w, "\\t", 2);
        else if (c == 8) ej__raw(w, "\\b", 2);
        else if (c == 12) ej__raw(w, "\\f", 2);
        else if (c < 0x20 || c == '<') {
            char u[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            ej__raw(w, u, 6);
        } else ej__raw(w, (const char *)&c, 1);
    }
    ej__raw(w, "\"", 1);
}

static int ej__strlen(const char *s) {
    int n = 0;
    while (s[n]) n++;
    return n;
}

/* An object member's key of n bytes (UTF-8); the next call writes its value. */
static void ej_key_n(ej_writer *w, const char *name, int n) {
    ej__item(w);
    ej__quoted(w, name, n);
    ej__raw(w, ":", 1);
    w->after_key = 1;
}
static void ej_key(ej_writer *w, const char *name) { ej_key_n(w, name, ej__strlen(name)); }

/* A string of n bytes (UTF-8). */
static void ej_string_n(ej_writer *w, const char *text, int n) {
    ej__item(w);
    ej__quoted(w, text, n);
}
static void ej_string_z(ej_writer *w, const char *text) { ej_string_n(w, text, ej__strlen(text)); }

/* A decimal in plain notation, trailing fractional zeros dropped (7700.5, 7700). */
static void ej_decimal_write(ej_writer *w, ej_decimal d) {
    ej__item(w);
    if (d.scale < 0 || d.scale > 18) { /* not a decimal ej_decimal_of or _add makes */
        w->overflow = 1;
        return;
    }
    long long units = d.units;
    int scale = d.scale;
    for (; scale > 0 && units % 10 == 0; scale--) units /= 10;
    unsigned long long magnitude = units < 0 ? 0ULL - (unsigned long long)units : units;
    char text[48];
    int i = sizeof text;
    for (int written = 0; magnitude > 0 || written <= scale; written++) {
        if (written == scale && scale > 0) text[--i] = '.';
        text[--i] = (char)('0' + magnitude % 10);
        magnitude /= 10;
    }
    if (units < 0) text[--i] = '-';
    ej__raw(w, text + i, (int)sizeof text - i);
}

static void ej_int(ej_writer *w, long long n) {
    ej_decimal d = {n, 0};
    ej_decimal_write(w, d);
}
static void ej_bool(ej_writer *w, int b) {
    ej__item(w);
    ej__raw(w, b ? "true" : "false", b ? 4 : 5);
}
static void ej_null(ej_writer *w) { ej__item(w), ej__raw(w, "null", 4); }

/* A value's JSON text as it is (a number as the input wrote it). */
static void ej_json(ej_writer *w, const char *text, int n) { ej__item(w), ej__raw(w, text, n); }

static int ej_finish(ej_writer *w) { return w->overflow || w->depth != 0 ? -1 : w->len; }

#endif
