/* bf16 dot products against float32 FMAs on this CPU, one core: the ceiling a bf16 attention kernel would have over
 * banyan's float32 one (prefill attention is FMA-bound: benchmarks/README.md, thirteenth session).
 *
 *     cc -O2 -mavx512f -mavx512bf16 benchmarks/bf16_dot_rate.c -o /tmp/bf16_dot_rate && /tmp/bf16_dot_rate
 *
 * 12 independent chains of each instruction (512-bit), so throughput, not latency, is timed. vdpbf16ps does 32
 * products and sums into 16 float32 lanes (64 flops), vfmadd231ps 16 multiply-adds (32 flops). Needs AVX512-BF16. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 100000000L
int main(void){
  __m512 a0=_mm512_set1_ps(1e-9f),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m512bh b=(__m512bh)_mm512_set1_epi16(0x3f80);
  double t=now();
  for(long i=0;i<N;i++){
    __asm__ volatile(
     "vdpbf16ps %12,%12,%0\n vdpbf16ps %12,%12,%1\n vdpbf16ps %12,%12,%2\n vdpbf16ps %12,%12,%3\n"
     "vdpbf16ps %12,%12,%4\n vdpbf16ps %12,%12,%5\n vdpbf16ps %12,%12,%6\n vdpbf16ps %12,%12,%7\n"
     "vdpbf16ps %12,%12,%8\n vdpbf16ps %12,%12,%9\n vdpbf16ps %12,%12,%10\n vdpbf16ps %12,%12,%11\n"
     :"+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11):"v"(b));
  }
  double dt=now()-t; printf("vdpbf16ps zmm: %.2f G/s -> %.1f GFLOP/s (64 flops each)\n", 12.0*N/dt/1e9, 12.0*N*64/dt/1e9);
  __m512 c=_mm512_set1_ps(1.0f);
  t=now();
  for(long i=0;i<N;i++){
    __asm__ volatile(
     "vfmadd231ps %12,%12,%0\n vfmadd231ps %12,%12,%1\n vfmadd231ps %12,%12,%2\n vfmadd231ps %12,%12,%3\n"
     "vfmadd231ps %12,%12,%4\n vfmadd231ps %12,%12,%5\n vfmadd231ps %12,%12,%6\n vfmadd231ps %12,%12,%7\n"
     "vfmadd231ps %12,%12,%8\n vfmadd231ps %12,%12,%9\n vfmadd231ps %12,%12,%10\n vfmadd231ps %12,%12,%11\n"
     :"+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11):"v"(c));
  }
  dt=now()-t; printf("vfmadd231ps zmm: %.2f G/s -> %.1f GFLOP/s (32 flops each)\n", 12.0*N/dt/1e9, 12.0*N*32/dt/1e9);
  float s[16]; _mm512_storeu_ps(s,_mm512_add_ps(a0,a11)); return s[0]==12345.f;
}
