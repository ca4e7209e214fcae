/*
 * A minimal unit-test harness: CHECK() records a failure and goes on,
 * KVF_TEST() registers a case, KVF_TEST_MAIN() runs them all and prints
 * "N passed, N failed".  Each test file is its own executable (ctest gives
 * it a process and a timeout).  log_lines_during counts what the library
 * logged while a function ran.
 */
#ifndef KVF_TEST_H
#define KVF_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef void (*kvf_test_fn_t)(void);

static int kvf_test_failures_;   /* failed CHECKs in the current case */

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                    \
            kvf_test_failures_++;                                              \
        }                                                                      \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                     \
    do {                                                                       \
        long long a_ = (long long)(a), b_ = (long long)(b);                    \
        if (a_ != b_) {                                                        \
            fprintf(stderr, "  %s:%d: CHECK failed: %s == %s (%lld != %lld)\n",\
                    __FILE__, __LINE__, #a, #b, a_, b_);                       \
            kvf_test_failures_++;                                              \
        }                                                                      \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                        \
    do {                                                                       \
        const char *h_ = (hay), *n_ = (needle);                                \
        if (h_ == NULL || strstr(h_, n_) == NULL) {                            \
            fprintf(stderr, "  %s:%d: \"%s\" does not contain \"%s\"\n",       \
                    __FILE__, __LINE__, h_ ? h_ : "(null)", n_);               \
            kvf_test_failures_++;                                              \
        }                                                                      \
    } while (0)

typedef struct { const char *name; kvf_test_fn_t fn; } kvf_test_case_t;

/* No arguments: every case; otherwise the cases named. */
static inline int kvf_test_selected_(int argc, char **argv, const char *name)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return 1;
    return argc <= 1;
}

/* Run the cases (every one, or those named in argv); prints a line
 * per case and the totals.  @return main's exit status. */
static inline int kvf_test_run(const kvf_test_case_t *cases, size_t n, int argc, char **argv)
{
    int passed = 0, failed = 0;
    for (size_t i = 0; i < n; i++) {
        if (!kvf_test_selected_(argc, argv, cases[i].name))
            continue;
        kvf_test_failures_ = 0;
        cases[i].fn();
        if (kvf_test_failures_) {
            printf("FAIL %s\n", cases[i].name);
            failed++;
        } else {
            printf("ok   %s\n", cases[i].name);
            passed++;
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

#define KVF_TEST_MAIN(...)                                                     \
    int main(int argc, char **argv)                                            \
    {                                                                          \
        kvf_test_case_t cases[] = {__VA_ARGS__};                               \
        return kvf_test_run(cases, sizeof(cases) / sizeof(cases[0]), argc, argv); \
    }

#define KVF_CASE(fn) { #fn, fn }

/* 1 if the n bytes at p are all zero (pages nothing was placed in). */
static inline int all_zero(const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != 0)
            return 0;
    return 1;
}

/* Run fn(arg) with this process's stderr (the log) going to a file, and
 * @return how many lines of it contain `needle`. */
static inline int log_lines_during(void (*fn)(void *), void *arg, const char *needle)
{
    char path[] = "/tmp/kvf-test-log-XXXXXX", line[2048];
    int fd = mkstemp(path), saved = dup(2), n = 0;
    CHECK(fd >= 0 && saved >= 0);
    if (fd < 0 || saved < 0)
        return -1;
    fflush(stderr);
    dup2(fd, 2);
    fn(arg);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    FILE *f = fdopen(fd, "r");
    rewind(f);
    while (fgets(line, sizeof(line), f) != NULL)
        n += strstr(line, needle) != NULL;
    fclose(f);
    unlink(path);
    return n;
}

#endif /* KVF_TEST_H */
