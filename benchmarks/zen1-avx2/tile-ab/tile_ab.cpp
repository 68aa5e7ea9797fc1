// A/B of two builds of the AVX2 op table's tiles (tile_ab.sh builds them), alternating in one process: `tile`
// over one matrix of random codes (code 0, int8 -128, which the quantizer never writes, left out), its tiles
// split over THREADS threads (0: one thread, the matrix 200 times over, for a matrix that fits in cache), for
// 1..MAXROWS activation rows; median and best ms of ROUNDS rounds, and whether the two builds' outputs agree
// bit for bit.  usage: tile_ab N K FMT(4|8) ROUNDS THREADS [MAXROWS=3] [GROUP=128]
#include "qk_ops.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <thread>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <sys/mman.h>
using namespace qk;
extern "C" const qk::Ops* qk_ops_avx2_v();
int main(int argc, char** argv){
  int64_t n = atoll(argv[1]), k = atoll(argv[2]); int fmt = atoi(argv[3]); int rounds = atoi(argv[4]); int th = atoi(argv[5]); int maxrows = argc > 6 ? atoi(argv[6]) : 3; int grp = argc > 7 ? atoi(argv[7]) : 128;
  const Ops* ops[2] = {qk_ops_avx2(), qk_ops_avx2_v()};
  int64_t nt = (n+15)/16, nb = k/32;
  size_t bytes = fmt==8 ? nt*nb*512 : nt*nb*256;
  size_t al = (bytes + (2<<20)) & ~((size_t(2)<<20)-1);
  uint8_t* qw = (uint8_t*)aligned_alloc(2<<20, al); madvise(qw, al, MADV_HUGEPAGE);
  for(size_t i=0;i+8<=bytes;i+=8){ uint64_t r = (uint64_t)rand()*2654435761u ^ ((uint64_t)rand()<<32); memcpy(qw+i,&r,8);} for(size_t i=0;i<bytes;i++) if(!qw[i]) qw[i]=1; 
  std::vector<float> sc8(nt*16, 0.01f); std::vector<uint16_t> sc4(nt*(k/grp)*16, 0x3c00);
  QMat m{qw, fmt==8?(const void*)sc8.data():(const void*)sc4.data(), nullptr, fmt, grp, n, k};
  std::vector<float> x(k); QAct a[4]; std::vector<int8_t> q[4]; std::vector<float> d[4], ds[4]; std::vector<int32_t> s[4];
  for(int r=0;r<4;r++){ for(auto& v:x) v = rand()/(float)RAND_MAX-0.5f; q[r].resize(k); d[r].resize(nb); s[r].resize(nb); ds[r].resize(nb);
    ops[0]->quantize_row(x.data(), k, q[r].data(), d[r].data(), s[r].data(), ds[r].data()); a[r]={q[r].data(),d[r].data(),s[r].data(),ds[r].data(),nullptr}; }
  std::vector<float> out[2] = {std::vector<float>(4*16*nt), std::vector<float>(4*16*nt)};
  for(int rows=1; rows<=maxrows; rows++){
    std::vector<double> t[2];
    for(int rd=0; rd<rounds; rd++) for(int vi=0; vi<2; vi++){
      int v = (rd & 1) ? 1 - vi : vi;
      auto t0=std::chrono::steady_clock::now();
      std::vector<std::thread> ts;
      if (th == 0) { for (int rep = 0; rep < 200; ++rep) for(int64_t tt=0;tt<nt;tt++) ops[v]->tile(m, tt, a, rows, out[v].data()+tt*16*rows); }
      for(int i=0;i<th;i++) ts.emplace_back([&,i,v]{ int64_t a0=nt*i/th, a1=nt*(i+1)/th; for(int64_t tt=a0;tt<a1;tt++) ops[v]->tile(m, tt, a, rows, out[v].data()+tt*16*rows); });
      for(auto& tj: ts) tj.join();
      t[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count()*1e3);
    }
    for(int v=0;v<2;v++) std::sort(t[v].begin(), t[v].end());
    bool same = memcmp(out[0].data(), out[1].data(), nt*16*rows*4) == 0;
    printf("fmt %d n %ld rows %d th %d: base med %.2f min %.2f | var med %.2f min %.2f | var/base %.3f  same bits %s\n", fmt, n, rows, th,
      t[0][rounds/2], t[0][0], t[1][rounds/2], t[1][0], t[1][rounds/2]/t[0][rounds/2], same?"yes":"NO");
  }
}
