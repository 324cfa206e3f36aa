/* mdcli's one pool of threads for its kernels: one job's runs split over a few threads, each run done
 * by the same code into its own part of the output, so the numbers do not depend on which thread
 * takes which run, nor on the thread count (mdcli_pool_set_threads: torch's, set from Python before
 * each kernel call).
 *
 * One pool for every kernel library, built as its own library and handed to each kernel at load
 * (pool.h's use_pool, mdcli.backends.native.build): the block kernel's products and the attention
 * kernel's groups alternate many times a step, and when each library kept workers of its own, the
 * two sets spun against each other for the same spare cores (Zen 5, two threads, the embedded
 * model's one-branch step at 1,819 tokens: 9.8-9.9 ms on two pools, 8.7-8.9 on one;
 * notebook/gguf-blocks.md, "One pool of threads, and a short OpenMP spin").
 *
 * The calling thread takes runs too, until none is left, and only then waits for the runs others
 * took: a worker that is slow to wake (its core busy with torch's own threads, which spin a while
 * after each of their operations, or with another process) leaves its runs to the caller, so a job
 * is never slower than on one thread by more than a few atomic operations. Workers wait for the next
 * job spinning briefly, then asleep on a condition variable, so that between jobs they leave the
 * cores to torch's threads and to other processes.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define spin_pause() _mm_pause()
#elif defined(__aarch64__)
#define spin_pause() __asm__ volatile("yield")
#else
#define spin_pause() ((void)0)
#endif
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

/* Run `index` of a job: its part of the output, with this thread's scratch of the job's size. */
typedef void (*run_fn)(const void *job, int index, float *scratch);

#define MAX_THREADS 64
#ifndef SPINS
#define SPINS 4096 /* checks of the job counter before a worker sleeps */
#endif

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_long generation;    /* one more per job handed out: wakes the workers */
    atomic_uint_fast64_t next; /* the job's generation (high 32 bits) and its next run (low 32) */
    atomic_int done;           /* runs finished */
    int threads;               /* threads per job: the workers and the calling thread */
    int runs;
    pid_t owner; /* the process that started the workers (a fork has none) */
    run_fn fn;
    const void *job;
    int64_t scratch_floats; /* each thread's scratch for this job */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 1, 0, 0, NULL, NULL, 0};

/* Take and do runs of job `generation` until none is left (a stale generation takes none). */
static void take_runs(uint32_t generation, float *scratch) {
    uint_fast64_t ticket = atomic_load_explicit(&pool.next, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(ticket >> 32) != generation || (int)(uint32_t)ticket >= pool.runs)
            return;
        if (!atomic_compare_exchange_weak_explicit(&pool.next, &ticket, ticket + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* another thread took it: ticket now holds the counter's new value */
        pool.fn(pool.job, (int)(uint32_t)ticket, scratch);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        ticket = atomic_load_explicit(&pool.next, memory_order_acquire);
    }
}

struct start { long seen; }; /* the last job handed out before a worker started */

static void *worker(void *arg) {
    long seen = ((struct start *)arg)->seen; /* read before the thread existed: no later job is missed */
    free(arg);
    float *scratch = NULL;
    int64_t capacity = 0;
    for (;;) {
        long now = atomic_load_explicit(&pool.generation, memory_order_acquire);
        for (int spin = 0; now == seen && spin < SPINS; spin++) {
            spin_pause();
            now = atomic_load_explicit(&pool.generation, memory_order_acquire);
        }
        if (now == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((now = atomic_load(&pool.generation)) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        const int64_t wanted = pool.scratch_floats; /* read after the generation: this job's (or a later one's) */
        if (capacity < wanted) { /* this worker's own scratch */
            float *grown = malloc(wanted * sizeof(float));
            if (grown == NULL)
                continue; /* the caller takes the runs */
            free(scratch);
            scratch = grown;
            capacity = wanted;
        }
        take_runs((uint32_t)now, scratch);
    }
    return NULL;
}

static int started = 1; /* threads running in this process, the calling thread included */
static atomic_flag busy = ATOMIC_FLAG_INIT;

/* Jobs split over `threads` threads from now on (1: the calling thread alone). Returns the count in
 * force (fewer where threads could not be started). */
int mdcli_pool_set_threads(int threads) {
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (pool.owner != getpid()) { /* a forked child has none of its parent's workers */
        started = 1;
        pool.owner = getpid();
    }
    while (started < threads) {
        pthread_t thread;
        struct start *begin = malloc(sizeof *begin);
        if (begin == NULL)
            break;
        begin->seen = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, worker, begin) != 0) {
            free(begin);
            break;
        }
        pthread_detach(thread);
        started++;
    }
    pool.threads = threads < started ? threads : started;
    return pool.threads;
}

/* Threads per job now in force. */
int mdcli_pool_threads(void) { return pool.threads; }

/* Runs [0, runs) of `job`, each fn(job, index, a thread's scratch of scratch_floats): on the workers
 * and the calling thread (whose scratch is `scratch`), or all on the calling thread where there is
 * one run, one thread, or another thread's job is on the workers. */
void mdcli_pool_parallel(int runs, run_fn fn, const void *job, int64_t scratch_floats, float *scratch) {
    if (runs <= 1 || pool.threads <= 1 || pool.owner != getpid() || atomic_flag_test_and_set(&busy)) {
        for (int index = 0; index < runs; index++)
            fn(job, index, scratch);
        return;
    }
    pool.fn = fn, pool.job = job, pool.runs = runs, pool.scratch_floats = scratch_floats;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const long generation = atomic_load(&pool.generation) + 1;
    atomic_store_explicit(&pool.next, (uint_fast64_t)(uint32_t)generation << 32, memory_order_release);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.generation, generation, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_runs((uint32_t)generation, scratch);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < pool.runs)
        spin_pause();
    atomic_flag_clear(&busy);
}
