// ISA-neutral declarations shared by amxopt's native kernels: element types, activations, the
// CPU's kernel tiers, and the dispatch tables that the ISA-specific translation units fill in.
//
// Layout of the sources: the drivers (ops.cpp: op entry points and input checks; gemm.cpp: packing,
// blocking, threading, the brgemm and fp32 engines; attention.cpp; norm.cpp) are compiled for
// plain x86-64. What needs an ISA lives in its own translation unit, built with that ISA's flags
// (amxopt/ops/build.py): vec_{default,avx2,avx512}.cpp compile vec_kernels.h once per ISA, and
// *_avx512_bf16.cpp hold the hand-written AVX-512-BF16 kernels. Nothing ISA-specific runs unless
// cpu.cpp found the instructions on this CPU.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace amxopt {

using bf16 = at::BFloat16;

enum class Act : int { None, Gelu, GeluTanh, Silu };

// Packed bf16 Linear weight ("VNNI"): [ceil(N/kNB)][K/2][kNB][2], N zero padded to kNB, K even,
// followed by zeros. Its shape, [N, K/2 + ceil(r (K + 1) / 2N), 2] with r = the padding columns,
// names N and K exactly (the middle size grows with K at a given N), so a weight packed for another
// in- or out-features is refused by the shape check; its three dims tell it from the plain [N, K]
// layout, which odd K (and fp32) keep. The kernels read it flat, through its data pointer.
constexpr int64_t kNB = 32;

// A 32-bit value (a bf16 pair moved as one) where it may be only 2-byte aligned: a bf16 tensor's
// view at an odd element offset (`big[1:]`). Dereferencing a uint32_t* there is undefined (UBSan);
// memcpy compiles to the same unaligned load.
inline uint32_t load32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store32(void* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }
inline std::vector<int64_t> vnni_shape(int64_t n, int64_t k) {
  const int64_t r = (n + kNB - 1) / kNB * kNB - n;
  return {n, k / 2 + (r * (k + 1) + 2 * n - 1) / (2 * n), 2};
}

// Uninitialised scratch of n elements of a trivial type, aligned to a cache line. brgemm's AMX tile
// rows (64 bytes) read from or written to a buffer that is only 16-byte aligned (std::vector, new[])
// straddle two lines: measured on an AMX Xeon, the same brgemm calls of attention ran 1.2x (Q K^T)
// and 1.45x (P V) slower than ATen's on its 64-byte aligned buffers.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n) : p_(static_cast<T*>(::operator new(sizeof(T) * std::max<int64_t>(n, 1), kAlign))) {}
  ~Scratch() { ::operator delete(p_, kAlign); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* data() const { return p_; }

 private:
  static constexpr std::align_val_t kAlign{64};
  T* p_;
};

// A per-thread scratch buffer of at least n elements (uninitialised, cache-line aligned), kept for
// the thread's later calls and grown when a call needs more; Slot tells apart the buffers one call
// holds at once. For the per-thread buffers of the kernels' parallel regions: freed after each call,
// a few hundred KB come back from mmap and page-fault on every touch (an AMX Xeon VM: 1300-1900
// faults per call of 8 x 104 attention, half of its time).
template <typename T, int Slot>
T* thread_scratch(int64_t n) {
  struct Buffer {
    T* p = nullptr;
    int64_t size = 0;
    ~Buffer() { ::operator delete(p, std::align_val_t{64}); }
  };
  thread_local Buffer b;
  if (n > b.size) {
    ::operator delete(b.p, std::align_val_t{64});
    b.p = nullptr;  // stays consistent if the new one throws
    b.size = 0;
    b.p = static_cast<T*>(::operator new(sizeof(T) * n, std::align_val_t{64}));
    b.size = n;
  }
  return b.p;
}

// An uninitialised op output. glibc maps every allocation above 32 MB fresh from the kernel and
// frees it back, so such an output page-faults on every 4 KB of its first write (the Qwen3-Omni
// encoder's first conv, 92 MB out: 22,500 faults a call): outputs of 32 MB or more come from a pool
// of freed outputs of the same size (cpu.cpp), so that a model's repeated calls fault only once.
// A new buffer's 2 MB-aligned interior is advised as transparent huge pages (madvise
// MADV_HUGEPAGE; ignored where THP is off) where the kernel's THP defrag policy cannot make a fault
// wait for memory compaction (47 against 68 ms for that conv with the advice, 1,000 faults; an AMX
// Xeon VM). Smaller outputs come back from glibc's heap already mapped.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);
void release_output_pool();   // give the pool's freed outputs back to the system
int64_t output_pool_bytes();  // bytes of freed outputs the pool holds
bool set_output_pool_enabled(bool on);  // new outputs from the pool or not; returns the last state
bool output_pool_enabled();             // on, and AMXOPT_OUTPUT_POOL_MB is not 0

// Work items [0, n) over at::parallel_for's threads. Each thread starts on its own contiguous share
// (as a static split would give it, so a thread's items share their operands in its caches) and,
// when that is done, takes items one at a time from the back of the share with the most left (items
// may differ in size: causal attention's). On shared cores a neighbour can slow one core for a while
// (2 threads of an AMX Xeon VM ran one GEMM loop at 0.62x to 2.02x of one thread's speed); with a
// static split the other core then waits at the end.
class WorkShares {
 public:
  WorkShares(int64_t n, int64_t parts);
  // The next item for share p, or -1 when every share is done.
  int64_t take(int64_t p);

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> v;  // front (low 32 bits) and back (high 32 bits) of a share
  };
  std::vector<Range> ranges_;
};

// body(next) once per share, in parallel; next() returns the share's items, then stolen ones, then -1.
template <typename Body>
void parallel_shares(int64_t n, const Body& body) {
  if (n <= 0) return;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  WorkShares shares(n, parts);
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) body([&shares, p] { return shares.take(p); });
  });
}

// The fewest rows a thread takes in an op split by rows: ATen's own grain (32768 elements) and at
// least 16 rows, so that a small tensor is one thread's work, which at::parallel_for runs inline.
// Waking the pool costs more than it saves there; on a loaded machine, where the second thread
// waited for a core, a 2 x 64 x 32 gated residual took 3-8 ms against eager's 0.03.
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(16, at::internal::GRAIN_SIZE / std::max<int64_t>(row_elems, 1));
}

// How fully n work items of equal size keep `threads` threads busy: n over threads x the items the
// busiest thread runs (1 where they divide evenly; 10 items on 56 threads: 0.18).
inline double balance(int64_t n, int64_t threads) {
  if (n <= 0 || threads <= 1) return 1.0;
  return double(n) / double(threads * ((n + threads - 1) / threads));
}

// Work items sized to the thread count. A kernel's item sizes were tuned on 2 cores, where every
// model shape has dozens of them; on a many-core Xeon the same items leave most cores idle (the
// K-blocked AMX GEMM cut Qwen3-Omni's fc2, 390 x 5120 x 1280, into 10 items: 46 of 56 threads had
// none). Of `count` candidate splits, ordered from the largest item (the tuned one) to the smallest,
// this picks the first whose items(i) keep the threads kMinBalance busy, else the best balanced one
// (the larger on a tie). A smaller item costs some reuse of operands in the caches, an idle core all
// of its share.
constexpr double kMinBalance = 0.85;
template <typename Items>
int pick_split(int count, int64_t threads, const Items& items) {
  int best = 0;
  double best_balance = -1.0;
  for (int i = 0; i < count; ++i) {
    const double b = balance(items(i), threads);
    if (b >= kMinBalance) return i;
    if (b > best_balance) best = i, best_balance = b;
  }
  return best;
}

// A GEMM's work item: `rows` rows x `blocks` column blocks of kNB; `items` of them cover the output.
struct WorkSplit {
  int64_t rows, blocks, items;
};

// What a GEMM does to its fp32 accumulator before the one rounding to the output's dtype T: + bias
// (fp32, per column; or null), the activation, then + residual (T, rows ldr apart; or null).
template <class T>
struct Epilogue {
  const float* bias = nullptr;
  Act act = Act::None;
  const T* residual = nullptr;
  int64_t ldr = 0;
  // The epilogue of the output block that starts at row m, column n.
  Epilogue at(int64_t m, int64_t n) const {
    return {bias ? bias + n : nullptr, act, residual ? residual + m * ldr + n : nullptr, ldr};
  }
};

// --- per-ISA vector kernels (vec_kernels.h, compiled once per ISA) -------------------------------
struct VecKernels {
  const char* isa;
  // out[r][c] = act(acc[r][c] + bias[c]) + residual[r][c] for r < rows, c < cols (e's block: e.at(...)
  // of the output's); acc is scratch.
  void (*epilogue_bf16)(float* acc, int64_t lda, const Epilogue<bf16>& e, bf16* out, int64_t ldo, int64_t rows,
                        int64_t cols);
  void (*epilogue_f32)(float* acc, int64_t lda, const Epilogue<float>& e, float* out, int64_t ldo, int64_t rows,
                       int64_t cols);
  void (*bf16_to_f32)(const bf16* src, float* dst, int64_t n);
  // One VNNI column block ([pairs][kNB][2] bf16) -> fp32 [2 * pairs][ldd] (its kNB columns).
  void (*unpack_vnni)(const bf16* src, int64_t pairs, float* dst, int64_t ldd);
  // out[0..kNB) = a[0..2*pairs) (fp32) x one VNNI column block: the small-M kernel of the fp32 tier.
  void (*gemv_vnni)(const float* a, const bf16* block, int64_t pairs, float* out);
  // LayerNorm (rms=false) or RMSNorm over rows of D, fp32 math; w/b fp32 or null; buf holds D floats.
  // With scale (then shift too; fp32, D each, shared by these rows): y = norm(x) * (1 + scale) + shift.
  void (*norm_bf16)(const bf16* x, int64_t ldx, bf16* y, int64_t rows, int64_t D, const float* w, const float* b,
                    const float* scale, const float* shift, float eps, bool rms, float* buf);
  void (*norm_f32)(const float* x, int64_t ldx, float* y, int64_t rows, int64_t D, const float* w, const float* b,
                   const float* scale, const float* shift, float eps, bool rms, float* buf);
  // One row: out = x + y * gate (gate fp32), fp32 math, rounded once.
  void (*residual_bf16)(const bf16* x, const bf16* y, const float* gate, bf16* out, int64_t D);
  void (*residual_f32)(const float* x, const float* y, const float* gate, float* out, int64_t D);
  // One row of D = 2H rotated by cos/sin (fp32); pairs (2i, 2i+1) if interleaved, else (i, i+H).
  // Pair i's outputs read cos[i] / sin[i], except the second half's (not interleaved) reading
  // cos[hi + i] / sin[hi + i]: hi = 0 for one angle per pair, H for rotate_half's factors per half.
  void (*rotary_bf16)(const bf16* x, bf16* out, int64_t D, const float* cos, const float* sin, int64_t hi,
                      bool interleaved);
  void (*rotary_f32)(const float* x, float* out, int64_t D, const float* cos, const float* sin, int64_t hi,
                     bool interleaved);
  // One query row of an online softmax over a key block of raw fp32 scores s: keys [0, visible) are
  // seen, [visible, n) masked. Writes p[0, n) (exp(scale * s - m'), 0 where masked), updates the
  // running max m (of scaled scores; -inf before any key) and sum l, returns exp(m - m') for the
  // row's accumulator (attention.cpp).
  float (*softmax_row_bf16)(const float* s, int64_t visible, int64_t n, float scale, float* m, float* l, bf16* p);
  float (*softmax_row_f32)(const float* s, int64_t visible, int64_t n, float scale, float* m, float* l, float* p);
  // out[0, n) = x * c, rounded once; out may be x.
  void (*scaled_bf16)(const float* x, int64_t n, float c, bf16* out);
  void (*scaled_f32)(const float* x, int64_t n, float c, float* out);
  // dst[j * ldd + i] = src[i * lds + j] (i < rows, j < cols) for 32-bit values: fp32, or bf16 pairs.
  void (*transpose32)(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols);
  // One VNNI pair row of n columns from two rows a, b (a[e] then b[e]; null = zeros), its columns in
  // panels of 32 that start `panel` bf16 apart (64: one contiguous row).
  void (*interleave_bf16)(const bf16* a, const bf16* b, int64_t n, int64_t panel, bf16* dst);
  // A convolution's channels-last outputs from gathered taps (conv.cpp): out[i * ldo + c] = bias[c] +
  // sum_k taps[k * n + i] * wt[k * cout + c] for i < n, c < cout, in fp32, then the activation,
  // rounded once (bias may be null).
  void (*conv_cols_bf16)(const float* taps, int64_t K, int64_t n, const float* wt, const float* bias, int64_t cout,
                         Act act, bf16* out, int64_t ldo);
  void (*conv_cols_f32)(const float* taps, int64_t K, int64_t n, const float* wt, const float* bias, int64_t cout,
                        Act act, float* out, int64_t ldo);
};
extern const VecKernels kVecDefault;  // vec_default.cpp (any x86-64)
extern const VecKernels kVecAvx2;     // vec_avx2.cpp (AVX2 + FMA)
extern const VecKernels kVecAvx512;   // vec_avx512.cpp (AVX-512 F/BW/VL/DQ)
extern const VecKernels kVecAvx512Bf16;  // vec_avx512_bf16.cpp (the same + AVX512-BF16)

// --- the CPU and its tiers (cpu.cpp) -------------------------------------------------------------
// bf16 compute tiers, best first: amx (oneDNN brgemm on AMX tiles), avx512_bf16 (vdpbf16ps),
// fp32 (bf16 operands converted to fp32, fp32 FMA: the right kernel where bf16 is emulated).
enum class Tier : int { Fp32 = 0, Avx512Bf16 = 1, Amx = 2 };
const char* tier_name(Tier t);
Tier parse_tier(const std::string& name);
Tier cpu_tier();       // the best tier this CPU runs (amx also where amx_emulated())
// AMXOPT_EMULATE_AMX=1 (read once) on a CPU with AVX-512-BF16 and without AMX: the amx tier runs, its
// tile kernel on software tiles (amx_emulated.cpp). For the tests; an error on a CPU without AVX-512-BF16.
bool amx_emulated();
Tier active_tier();    // min(cpu_tier(), the cap set by set_max_tier)
void set_max_tier(Tier t);
const VecKernels& vec();  // the widest vector ISA this CPU runs

// --- hand-written AVX-512-BF16 kernels (*_avx512_bf16.cpp) ---------------------------------------
// C[M, N] (ldc) = A[M, K] (lda) @ W^T with the epilogue e, W packed VNNI; K even; work items of
// split.rows rows (a multiple of kAvx512Rows) x split.blocks column blocks (gemm.cpp chooses them).
constexpr int64_t kAvx512Rows = 12;  // rows per microkernel call
void gemm_avx512_bf16(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                      int64_t M, int64_t N, int64_t K, const WorkSplit& split);

// --- the hand-written AMX tile kernel (gemm_amx.cpp) ----------------------------------------------
// The epilogue of a finished block (rows x cols of fp32 acc, lda apart, into out), run a few rows at a
// time between the K steps of the next block's tile kernel: the vector units are idle while the
// tile unit multiplies (gemm.cpp's gemm_blocks, where it measured faster with an activation).
struct OverlappedEpilogue {
  const VecKernels* v = nullptr;
  float* acc = nullptr;
  int64_t lda = 0;
  Epilogue<bf16> e;
  bf16* out = nullptr;
  int64_t ldo = 0, rows = 0, cols = 0, done = 0;
  int64_t steps = 0;  // K steps left to spread the rows over, where more than one call's (tile_block)
  void run(int64_t n) {
    n = std::min(n, rows - done);
    if (n <= 0) return;
    v->epilogue_bf16(acc + done * lda, lda, e.at(done, 0), out + done * ldo, ldo, n, cols);
    done += n;
  }
  void finish() { run(rows - done); }
};
// Whether this process may use AMX tiles (an AMX CPU, and Linux granted the tile state; or software
// tiles, where amx_emulated()).
bool amx_tiles_usable();
// Scope of one thread's use of amx_tile_32x32: loads its tile configuration (after making ATen's
// brgemm forget its own), releases the tiles at the end.
struct AmxTiles {
  AmxTiles();
  ~AmxTiles();
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};
// acc[32 x 32] (fp32, ldc apart) = A[32 x K] (lda) x a VNNI panel of 32 columns ([K/2][32][2]), or
// += with accumulate; K > 0 and K % 32 == 0, all 32 rows of A readable. Only inside an AmxTiles scope.
// With pending, the rows of that earlier block's epilogue are run a few at a time between the K
// steps, all of them by the end.
void amx_tile_32x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc = 32,
                    bool accumulate = false, OverlappedEpilogue* pending = nullptr);
// The same for 16 rows: acc rows 0-15 only.
void amx_tile_16x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc = 32,
                    bool accumulate = false, OverlappedEpilogue* pending = nullptr);
// The same two blocks on software tiles (amx_emulated.cpp), which the two above run instead when
// amx_emulated(); and how many blocks they have run in this process (for the tests).
void amx_emulated_32x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                        bool accumulate, OverlappedEpilogue* pending);
void amx_emulated_16x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                        bool accumulate, OverlappedEpilogue* pending);
int64_t amx_emulated_blocks();

// --- drivers shared between translation units -----------------------------------------------------
// conv.cpp: amxopt.conv2d computed directly, into a channels-last output, where Cin x kh x kw <=
// kDirectK and groups == 1 (nullopt otherwise, or where ATen's convolution should report the
// arguments), the activation applied before the one rounding. library.py's fake mirrors the condition.
constexpr int64_t kDirectK = 64;
// The bias in fp32 after a rounding to x's dtype, as the reference and ATen's path round it (an
// undefined tensor for none): every conv2d route adds it so, whatever route Cin x kh x kw and the tier pick.
at::Tensor rounded_bias(const std::optional<at::Tensor>& bias, at::ScalarType dtype);
std::optional<at::Tensor> conv2d_direct(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, Act act);
// ... and by im2col + gemm_bf16 for a bf16 x on the amx tier where Cin x kh x kw >
// kDirectK is even and groups == 1, into a channels-last output (nullopt otherwise).
std::optional<at::Tensor> conv2d_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                      int64_t groups, Act act, Tier tier);
// How the amx tier's tile engine orders its work below the K-blocked sizes (gemm.cpp): Groups (the
// default) hands out 32-row x 128-column items, column group major (row tile major at K <= 128), A
// read in place for the whole K; Rows (from 64 rows, and 32 per thread, at 128 < K) gives each
// thread its own rows of A, packed in 32 x 256 chunks that stay in L1 across a column group's 4
// panels. Default: the call's choice (amxopt.linear's amx_schedule, which autotune sets per shape),
// else Groups. The process may pin one instead, which then overrides every call's:
// AMXOPT_AMX_SCHEDULE (read when the library loads) or set_amx_schedule.
enum class AmxSchedule : int { Default = -1, Groups = 0, Rows = 1 };
const char* amx_schedule_name(AmxSchedule s);
std::optional<AmxSchedule> find_amx_schedule(c10::string_view name);  // "default", "groups", "rows"
AmxSchedule parse_amx_schedule(const std::string& name);  // find_amx_schedule, or an error naming the variable
AmxSchedule amx_schedule();                                // the process's: Default unless pinned
void set_amx_schedule(AmxSchedule s);                      // Default unpins
// The schedule a GEMM runs in: the pinned one, else the call's request, else Groups.
AmxSchedule amx_schedule_for(AmxSchedule requested);
// Whether gemm_bf16 on the active tier takes the Rows schedule's engine for M x K when asked to,
// so that the two schedules differ for this shape (autotune times them only then).
bool amx_schedule_matters(int64_t M, int64_t K);
// C = A @ W^T with the epilogue e for a bf16 x and VNNI-packed W, on the given tier (gemm.cpp), the amx
// tier's tile engine in amx_schedule_for(schedule).
void gemm_bf16(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc, int64_t M,
               int64_t N, int64_t K, Tier tier, AmxSchedule schedule = AmxSchedule::Default);
// Which engine gemm_bf16 uses for M rows on `tier` (for `amxopt info` and the benches).
const char* gemm_engine(Tier tier, int64_t M);
// The work items gemm_bf16 cuts a bf16 M x K (even K) x N into on the active tier for `threads`
// threads, in the process's pinned AMX schedule or else the default one: {rows, column blocks of kNB,
// items} (the rows of a chunk of the K-blocked and Rows engines; for the tests and `amxopt info`).
std::vector<int64_t> linear_work_split(int64_t M, int64_t N, int64_t K, int64_t threads);
at::Tensor pack_vnni(const at::Tensor& w);  // [N, K] bf16, K even -> VNNI
// act(x2 @ W^T + bias) + residual for x2 [M, K] with unit column stride; packed VNNI (bf16) or
// plain [N, K]; bias32 fp32 contiguous or undefined; residual [M, N] in x2's dtype with unit column
// stride, or undefined.
at::Tensor linear_2d(const at::Tensor& x2, const at::Tensor& packed, const at::Tensor& bias32, Act act, int64_t N,
                     Tier tier, const at::Tensor& residual = at::Tensor(),
                     AmxSchedule schedule = AmxSchedule::Default);
// attention.cpp. rotary_cos / rotary_sin: undefined, or fp32 [T, width] (contiguous) rotating the
// rows of q and k of token t (q and k of the same T tokens) before they are used, as rotary_native
// with cos[t] / sin[t] for every head.
at::Tensor varlen_attention_native(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale,
                                   bool causal, Tier tier, const at::Tensor& rotary_cos = at::Tensor(),
                                   const at::Tensor& rotary_sin = at::Tensor(), bool rotary_interleaved = false);
const char* attention_engine(Tier tier, const at::Tensor& q);
// The work items of the attention's second phase for `threads` threads, segments of q_lens query
// rows, bf16 (else fp32) block GEMMs: {query rows per item, items} (for the tests and benches).
std::vector<int64_t> attention_work_split(const std::vector<int64_t>& q_lens, int64_t heads, bool bf16_gemm,
                                          int64_t threads);
// norm.cpp; scale/shift (both or neither) broadcast to x: norm(x) * (1 + scale) + shift
at::Tensor norm_native(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, double eps, bool rms,
                       const std::optional<at::Tensor>& scale = std::nullopt,
                       const std::optional<at::Tensor>& shift = std::nullopt);
// glue.cpp: Wan's gated residual and rotary embedding; gate, cos and sin broadcast to x's rows (cos
// and sin D / 2 wide, or D wide for rotate_half's factors per half when not interleaved).
at::Tensor gated_residual_native(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gate);
at::Tensor rotary_native(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);

// The multi-index of row r of a [rows, D] view over x's leading dims: found once (divisions), then
// advanced row by row with a carry, so that each operand's row offset costs a few multiply-adds.
class LeadingIndex {
 public:
  LeadingIndex(at::IntArrayRef x_sizes, int64_t r);  // x's full sizes; row r of its leading dims
  void next();
  int64_t offset(const std::vector<int64_t>& strides) const;  // strides over the leading dims

 private:
  std::vector<int64_t> sizes_, idx_;
};

// The matching row of an operand laid over x's leading dims, read in place through its own strides
// (a q or k slice of a fused QKV output is not a [rows, D] view, and reshape would copy it); a copy
// only where its last dim is strided.
class OperandRows {
 public:
  explicit OperandRows(const at::Tensor& t);  // t's leading dims are x's
  // An fp32 operand `p` broadcast to x.sizes()[:-1] + [width] (gate, scale, cos, ...): stride 0 where
  // it broadcasts.
  static OperandRows broadcast(const at::Tensor& p, at::IntArrayRef x_sizes, int64_t width);
  template <typename T>
  const T* at(const LeadingIndex& i) const {
    return static_cast<const T*>(base_) + i.offset(strides_);
  }

 private:
  at::Tensor t_;
  const void* base_;
  std::vector<int64_t> strides_;  // over x's leading dims
};

}  // namespace amxopt
