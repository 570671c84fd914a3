/* The wall clock and the core's clock rate for banyan's C benchmarks: cycles are seconds times clock_hz(). */
#ifndef BANYAN_BENCH_CLOCK_H
#define BANYAN_BENCH_CLOCK_H
#include <time.h>

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* From a chain of dependent adds, one a cycle: the clock as the core runs it now (turbo, VM and all). */
static inline double clock_hz(void) {
    const long n = 200000000;
    long c = 1;
    const double start = now();
    for (long i = 0; i < n; i++)
        __asm__ volatile("add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n"
                         "add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n" : "+r"(c));
    return n * 10.0 / (now() - start);
}
#endif
