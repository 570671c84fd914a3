/* Whether AMX tile instructions run beside AVX-512 work on this CPU, in cycles, one core: what bounds
 * banyan/kernels/cpu_gemv.c's AMX path (amx_tile16), whose blocks each take a tile product and its store (the tile
 * unit) and then 16 rows of float steps (the vector units). If the two overlapped, a block would cost the larger of
 * the two; if they take turns, their sum.
 *
 *     cc -O2 -mavx512f -mamx-tile -mamx-int8 benchmarks/amx_overlap.c -o /tmp/amx_overlap && /tmp/amx_overlap
 *
 * Each line times a loop (the clock from a chain of dependent adds): 64 independent `vfmadd231ps` alone (about what
 * amx_tile16 spends on a block's float steps); a block's tile work alone, as amx_tile16 issues it (zero C, load A
 * and B, `tdpbsud`, store the other set's C); the two in one loop; the tile work without its zero and store; the
 * store alone beside the multiply-adds. Needs Linux to grant the tile state (arch_prctl ARCH_REQ_XCOMP_PERM). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"

#define N 10000000L
#define FMA4(a, b, c, d)                                                                                            \
    "vfmadd231ps %%zmm20, %%zmm21, %%zmm" #a "\n vfmadd231ps %%zmm20, %%zmm21, %%zmm" #b "\n"                       \
    "vfmadd231ps %%zmm20, %%zmm21, %%zmm" #c "\n vfmadd231ps %%zmm20, %%zmm21, %%zmm" #d "\n"
#define FMA16 FMA4(0, 1, 2, 3) FMA4(4, 5, 6, 7) FMA4(8, 9, 10, 11) FMA4(12, 13, 14, 15)
/* 64 multiply-adds into 16 sums: 4 deep, so the two FMA ports and not their latency bound them */
#define FMA64                                                                                                       \
    __asm__ volatile(FMA16 FMA16 FMA16 FMA16 ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",   \
                     "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")
/* block j into tile C = A (16 rows x 32 bytes) . B (8 rows x 64 bytes); the intrinsics take literal tile numbers */
#define PRODUCT(C, A, B, j)                                                                                         \
    do {                                                                                                            \
        _tile_loadd(A, a + 512 * (j), 32);                                                                          \
        _tile_loadd(B, b + 512 * (j), 64);                                                                          \
        _tile_dpbsud(C, A, B);                                                                                      \
    } while (0)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int8_t a[65 * 512] __attribute__((aligned(64)));
static uint8_t b[65 * 512] __attribute__((aligned(64)));
static int32_t dots[2][256] __attribute__((aligned(64)));

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        puts("Linux does not grant the AMX tile state here");
        return 1;
    }
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t++) {  /* as cpu_gemv.c's amx_configure: C 0-1, A 2-3, B 4-5 */
        config.rows[t] = t >= 4 ? 8 : 16;
        config.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    _tile_loadconfig(&config);
    const double ghz = clock_hz() * 1e-9;
    printf("clock %.2f GHz; cycles a block (or loop):\n", ghz);
#define TIME(LABEL, BODY)                                                                                           \
    do {                                                                                                            \
        const double start = now();                                                                                 \
        for (long i = 0; i < N; i += 2) {                                                                           \
            const int j = i & 63;                                                                                   \
            (void)j;                                                                                                \
            BODY;                                                                                                   \
        }                                                                                                           \
        printf("%-52s %6.1f\n", LABEL, (now() - start) * ghz * 1e9 / N);                                           \
    } while (0)
    TIME("64 vfmadd231ps alone", FMA64; FMA64);
    TIME("tile work alone (zero, 2 loads, tdpbsud, store)",
         _tile_zero(0); PRODUCT(0, 2, 4, j); _tile_stored(1, dots[1], 64);
         _tile_zero(1); PRODUCT(1, 3, 5, j + 1); _tile_stored(0, dots[0], 64));
    TIME("the tile work + 64 vfmadd231ps",
         _tile_zero(0); PRODUCT(0, 2, 4, j); _tile_stored(1, dots[1], 64); FMA64;
         _tile_zero(1); PRODUCT(1, 3, 5, j + 1); _tile_stored(0, dots[0], 64); FMA64);
    TIME("2 loads and tdpbsud + 64 vfmadd231ps", PRODUCT(0, 2, 4, j); FMA64; PRODUCT(1, 3, 5, j + 1); FMA64);
    TIME("a tile store + 64 vfmadd231ps", _tile_stored(1, dots[1], 64); FMA64; _tile_stored(0, dots[0], 64); FMA64);
    _tile_release();
    return dots[0][0] == 12345;
}
