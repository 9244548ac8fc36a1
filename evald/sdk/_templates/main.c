/* A template evald evaluator (ABI v1, docs/abi.md): an integer from 1 to 3999 in Roman
 * numerals, "1994" -> "MCMXCIV". No imports and no libc; the host writes the input into
 * input_buf, calls evald_eval(len) and reads output_buf[0..r] (a value) or [0..-r] (an error). */

#define INPUT_CAPACITY 64
#define OUTPUT_CAPACITY 256
#define EXPORT(name) __attribute__((export_name(name)))

static unsigned char input_buf[INPUT_CAPACITY];
static unsigned char output_buf[OUTPUT_CAPACITY];

EXPORT("evald_abi_version") int evald_abi_version(void) { return 1; }
EXPORT("evald_input_ptr") int evald_input_ptr(void) { return (int)(long)input_buf; }
EXPORT("evald_input_cap") int evald_input_cap(void) { return INPUT_CAPACITY; }
EXPORT("evald_output_ptr") int evald_output_ptr(void) { return (int)(long)output_buf; }
EXPORT("evald_output_cap") int evald_output_cap(void) { return OUTPUT_CAPACITY; }

/* Appends a NUL-terminated string at output_buf[n]; returns the new length. */
static int put(int n, const char *text) {
    while (*text) output_buf[n++] = (unsigned char)*text++;
    return n;
}

/* Writes CODE:message and returns minus its length (an error). */
static int fail(const char *code, const char *message) {
    return -put(put(put(0, code), ":"), message);
}

static const unsigned values[] = {1000, 900, 500, 400, 100, 90, 50, 40, 10, 9, 5, 4, 1};
static const char *const symbols[] = {"M", "CM", "D", "CD", "C", "XC", "L", "XL", "X", "IX",
                                      "V", "IV", "I"};

/* Returns the value's length, or minus the length of CODE:message (an error). */
EXPORT("evald_eval") int evald_eval(int input_len) {
    if (input_len < 0 || input_len > INPUT_CAPACITY) return fail("syntax", "input too long");
    if (input_len == 0) return fail("syntax", "expected a number");
    if (input_buf[0] == '0') return fail("syntax", "no leading zeros");
    unsigned number = 0;
    for (int i = 0; i < input_len; i++) {
        unsigned char c = input_buf[i];
        if (c < '0' || c > '9') return fail("syntax", "expected decimal digits only");
        if (number <= 3999) number = number * 10 + (c - '0');
    }
    if (number > 3999) return fail("domain", "Roman numerals cover 1 to 3999");
    int n = 0;
    for (int k = 0; k < 13; k++) {
        for (; number >= values[k]; number -= values[k]) n = put(n, symbols[k]);
    }
    return n;
}
