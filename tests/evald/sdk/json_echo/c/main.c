/* json_echo: reads one JSON value with evald_json.h and writes it back with its writer,
 * numbers as exact decimals where they fit (else as written), so a test can hold the library
 * to Python's json on any input. */
#include "evald_json.h"

#define EXPORT(name) __attribute__((export_name(name)))

static unsigned char input_buf[16384];
static unsigned char output_buf[65536];
static ej_token tokens[8192];
static char text[16384];

EXPORT("evald_abi_version") int evald_abi_version(void) { return 1; }
EXPORT("evald_input_ptr") int evald_input_ptr(void) { return (int)(long)input_buf; }
EXPORT("evald_input_cap") int evald_input_cap(void) { return sizeof input_buf; }
EXPORT("evald_output_ptr") int evald_output_ptr(void) { return (int)(long)output_buf; }
EXPORT("evald_output_cap") int evald_output_cap(void) { return sizeof output_buf; }

static int fail(const char *message) {
    const char *code = "syntax:";
    int n = 0;
    while (*code) output_buf[n++] = (unsigned char)*code++;
    while (*message) output_buf[n++] = (unsigned char)*message++;
    return -n;
}

static void write(ej_writer *w, const ej_doc *d, int i) {
    const ej_token *t = &d->tokens[i];
    ej_decimal number;
    switch (t->kind) {
    case EJ_NULL: ej_null(w); break;
    case EJ_BOOL: ej_bool(w, d->text[t->start] == 't'); break;
    case EJ_NUMBER:
        if (ej_decimal_of(d, i, &number)) ej_decimal_write(w, number);
        else ej_json(w, (const char *)d->text + t->start, t->end - t->start);
        break;
    case EJ_STRING: ej_string_n(w, text, ej_string(d, i, text, sizeof text)); break;
    case EJ_ARRAY:
        ej_begin_array(w);
        for (int k = 0, at = i + 1; k < t->size; k++, at = d->tokens[at].next) write(w, d, at);
        ej_end_array(w);
        break;
    case EJ_OBJECT:
        ej_begin_object(w);
        for (int k = 0, at = i + 1; k < t->size; k++, at = d->tokens[at + 1].next) {
            ej_key_n(w, text, ej_string(d, at, text, sizeof text));
            write(w, d, at + 1);
        }
        ej_end_object(w);
        break;
    }
}

EXPORT("evald_eval") int evald_eval(int input_len) {
    ej_doc doc;
    int error = ej_parse(&doc, input_buf, input_len, tokens, 8192);
    if (error != EJ_OK) return fail(ej_message(error));
    ej_writer w = ej_writer_init(output_buf, sizeof output_buf);
    write(&w, &doc, 0);
    int n = ej_finish(&w);
    return n < 0 ? fail("too large") : n;
}
