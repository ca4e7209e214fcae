/* Logging from several threads: the level may change while others log. */
#include <pthread.h>

#include "unit/kvf_test.h"
#include "util/log.h"

static void *log_main(void *arg)
{
    for (int i = 0; i < 20000; i++)
        kvf_debug("message %d", i);   /* below the level: never printed */
    kvf__set_last_error("error on another thread");
    return arg;
}

/* kvf_log_set_level() from one thread while another logs: under the
 * thread sanitizer this was a data race on the level. */
static void test_set_level_while_logging(void)
{
    pthread_t t;
    kvf_log_set_level(KVF_LOG_ERROR);
    CHECK_EQ_INT(pthread_create(&t, NULL, log_main, NULL), 0);
    for (int i = 0; i < 20000; i++)
        kvf_log_set_level(i % 2 ? KVF_LOG_WARN : KVF_LOG_ERROR);
    pthread_join(t, NULL);
    kvf_log_set_level(KVF_LOG_WARN);
    /* kvf_last_error() is per thread: the other thread's error is not ours. */
    CHECK(strstr(kvf_last_error(), "another thread") == NULL);
}

KVF_TEST_MAIN(KVF_CASE(test_set_level_while_logging))
