/* The kernels' side of mdcli's one pool of threads (pool.c, a library of its own): each kernel library
 * is handed the pool's functions once, at load (use_pool, called by mdcli.backends.native.build), so
 * every kernel's jobs run on the same workers. Until it is handed one, or where the pool did not
 * build, a job's runs all run on the calling thread, in order: the same numbers, on one core.
 *
 * Included by each kernel source (gguf_blocks.c, attention.c). */
#ifndef MDCLI_POOL_H
#define MDCLI_POOL_H
#include <stdint.h>

/* Run `index` of a job: its part of the output, with this thread's scratch of the job's size. */
typedef void (*run_fn)(const void *job, int index, float *scratch);
typedef void (*parallel_fn)(int runs, run_fn fn, const void *job, int64_t scratch_floats, float *scratch);
typedef int (*count_fn)(void);

static parallel_fn pool_parallel;
static count_fn pool_count;

/* This library's jobs from now on run on the pool whose mdcli_pool_parallel and mdcli_pool_threads these are. */
void use_pool(parallel_fn parallel_in_pool, count_fn threads_in_pool) {
    pool_parallel = parallel_in_pool;
    pool_count = threads_in_pool;
}

/* Threads a job is split over (1 without a pool). */
static inline int pool_threads(void) { return pool_count ? pool_count() : 1; }

/* Runs [0, runs) of `job`, each fn(job, index, a thread's scratch of scratch_floats floats): on the
 * pool's threads (the calling thread's scratch is `scratch`), or in order on the calling thread. */
static void parallel(int runs, run_fn fn, const void *job, int64_t scratch_floats, float *scratch) {
    if (pool_parallel != 0) {
        pool_parallel(runs, fn, job, scratch_floats, scratch);
        return;
    }
    for (int index = 0; index < runs; index++)
        fn(job, index, scratch);
}
#endif
