// What this CPU runs: the widest vector ISA for the VecKernels table, and the best bf16 tier; and
// how its threads share work (WorkShares).
// Read once from CPUID (through the compiler's __builtin_cpu_supports, which also checks that the OS
// saves the registers); AMX additionally needs the kernel's permission for the tile state, which
// at::cpu::init_amx() requests (arch_prctl), as oneDNN would on its first AMX kernel.
// AMXOPT_EMULATE_AMX=1 makes a CPU with AVX-512-BF16 and without usable AMX run the amx tier too,
// its tile kernel on software tiles (amx_emulated.cpp): for the tests.
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common.h"

namespace amxopt {
namespace {

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

bool has_amx() {
  // oneDNN packs bf16 for brgemm only where it will run it on AMX tiles.
  static const bool ok = has_avx512_bf16() && __builtin_cpu_supports("amx-bf16") &&
                         __builtin_cpu_supports("amx-tile") && at::cpu::init_amx() &&
                         at::native::cpublas::could_pack(at::kBFloat16);
  return ok;
}

// Whether oneDNN generates its bf16 brgemm here, which the avx512_bf16 tier's GEMMs and attention
// run: ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 switches it off on a CPU that has the instructions
// (every bf16 attention then failed with "could not generate a kernel"). oneDNN's own ISA query is
// not exported from libtorch, so this asks the way the kernels will: one small brgemm.
bool onednn_runs_bf16() {
  static const bool ok = [] {
    at::BFloat16 a[2] = {1.f, 1.f}, b[2 * 16];  // A 1 x 2, B 2 x 16 in VNNI pairs
    for (auto& x : b) x = 1.f;
    float c[16];
    try {
      at::native::cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a, b, c, true);
      at::native::cpublas::brgemm_release(true);
    } catch (const std::exception&) {
      return false;
    }
    return c[0] == 2.f;
  }();
  return ok;
}

Tier detect_tier() {
  const bool emulated = amx_emulated();  // first, so that a bad AMXOPT_EMULATE_AMX fails on every CPU
  if (has_amx() || emulated) return Tier::Amx;
  return has_avx512_bf16() && onednn_runs_bf16() ? Tier::Avx512Bf16 : Tier::Fp32;
}

std::atomic<int> max_tier{int(Tier::Amx)};

}  // namespace

bool amx_emulated() {
  static const bool on = [] {
    const char* env = std::getenv("AMXOPT_EMULATE_AMX");
    const std::string value = env ? env : "";
    TORCH_CHECK_VALUE(value.empty() || value == "0" || value == "1", "AMXOPT_EMULATE_AMX=", value,
                      ": not 0 or 1");
    if (value != "1" || has_amx()) return false;  // where the CPU's tiles are usable, they run
    // The amx tier also runs the AVX-512-BF16 kernels (M = 1, the vector tables): emulating the
    // tiles alone cannot make a CPU without them run it.
    TORCH_CHECK_VALUE(has_avx512_bf16(), "AMXOPT_EMULATE_AMX=1: the amx tier needs AVX-512-BF16 besides the tiles, ",
                      "and this CPU lacks it (its best tier is fp32)");
    return true;
  }();
  return on;
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::Amx:
      return "amx";
    case Tier::Avx512Bf16:
      return "avx512_bf16";
    case Tier::Fp32:
      return "fp32";
  }
  return "?";
}

Tier parse_tier(const std::string& name) {
  for (Tier t : {Tier::Fp32, Tier::Avx512Bf16, Tier::Amx})
    if (name == tier_name(t)) return t;
  TORCH_CHECK_VALUE(false, "amxopt: unknown tier '", name, "'; known: amx, avx512_bf16, fp32");
}

Tier cpu_tier() {
  static const Tier tier = detect_tier();
  return tier;
}

Tier active_tier() { return Tier(std::min(int(cpu_tier()), max_tier.load())); }

void set_max_tier(Tier t) { max_tier.store(int(t)); }

// The CPU's best table; AMXOPT_VEC_ISA (read once) can name a lower one, so that a machine with
// AVX-512 also runs the tables of CPUs without it (the tests do, in a fresh process).
const VecKernels& vec() {
  static const VecKernels& k = []() -> const VecKernels& {
    const VecKernels* tables[] = {&kVecAvx512Bf16, &kVecAvx512, &kVecAvx2, &kVecDefault};
    const bool usable[] = {has_avx512_bf16(), has_avx512(),
                           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), true};
    const char* cap = std::getenv("AMXOPT_VEC_ISA");
    bool capped = cap == nullptr;
    for (int i = 0; i < 4; ++i) {
      capped = capped || std::string(cap) == tables[i]->isa;
      if (capped && usable[i]) return *tables[i];
    }
    TORCH_CHECK_VALUE(capped, "AMXOPT_VEC_ISA=", cap, ": not one of avx512_bf16, avx512, avx2, default");
    return kVecDefault;
  }();
  return k;
}

namespace {

constexpr uint64_t pack_range(uint64_t front, uint64_t back) { return front | back << 32; }

}  // namespace

WorkShares::WorkShares(int64_t n, int64_t parts) : ranges_(std::max<int64_t>(parts, 1)) {
  TORCH_CHECK(n < (int64_t(1) << 32), "amxopt: too many work items (", n, ")");
  const int64_t np = int64_t(ranges_.size());
  for (int64_t p = 0; p < np; ++p) ranges_[p].v.store(pack_range(n * p / np, n * (p + 1) / np));
}

int64_t WorkShares::take(int64_t p) {
  // Own share, from the front.
  uint64_t r = ranges_[p].v.load();
  while (uint32_t(r) < (r >> 32))
    if (ranges_[p].v.compare_exchange_weak(r, r + 1)) return int64_t(uint32_t(r));
  // Then one item at a time from the back of the share with the most left.
  while (true) {
    int64_t victim = -1;
    uint64_t most = 0;
    for (int64_t q = 0; q < int64_t(ranges_.size()); ++q) {
      const uint64_t v = ranges_[q].v.load(), left = (v >> 32) - std::min<uint64_t>(uint32_t(v), v >> 32);
      if (left > most) most = left, victim = q;
    }
    if (victim < 0) return -1;
    uint64_t v = ranges_[victim].v.load();
    const uint64_t front = uint32_t(v), back = v >> 32;
    if (front < back && ranges_[victim].v.compare_exchange_weak(v, pack_range(front, back - 1)))
      return int64_t(back - 1);
  }
}

namespace {

// Whether a fault in a region advised MADV_HUGEPAGE returns without waiting for the kernel to
// compact memory: the THP defrag policy (/sys/kernel/mm/transparent_hugepage/defrag) is "defer" or
// "never". Under "madvise" (the kernel's default), "defer+madvise" and "always", such a fault
// compacts memory on the spot when no free 2 MB page is at hand, and fragmented memory makes that
// slow: on a Granite Rapids-class Xeon VM, the Qwen3-Omni encoder's first conv (92 MB out) took
// 126-138 ms a call with the advice (110-136 ms of it in the kernel), 24-32 ms without, in one
// process after a model's run; in a fresh process the advice saved 13 ms there (21 against 34).
bool huge_advice_cannot_stall() {
  static const bool ok = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/defrag");
    std::string policy;
    std::getline(f, policy);
    return policy.find("[defer]") != std::string::npos || policy.find("[never]") != std::string::npos;
  }();
  return ok;
}

constexpr uintptr_t kHuge = uintptr_t(1) << 21;

// Advise the 2 MB-aligned interior of [p, p + n) as transparent huge pages, where that cannot stall.
void advise_huge(void* p, size_t n) {
  if (!huge_advice_cannot_stall()) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + n;
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only
}

// Outputs of kPoolMinBytes or more come from a pool of freed ones of the same size. glibc maps such
// an allocation fresh on every call (its mmap threshold stops growing at 32 MB) and the first write
// faults in every 4 KB page: a 16384 x 1536 -> 8960 linear's 293 MB output took 71,700 faults a call
// (on a Zen 4 EPYC, 63 ms to allocate and fill 293 MB against 12 ms to fill it again), as eager's
// does. At real video sizes (Wan at 480p: 32,760 tokens) every activation is that large; on AMX,
// whose GEMMs run ~5x faster, the faults would be a third of such a call. A model calls its ops with
// the same shapes over and over, so freed outputs come back for the next call's. The pool holds at
// most AMXOPT_OUTPUT_POOL_MB (read once, at the pool's first use) of freed outputs, the oldest given back
// first (default: an eighth of the memory this process may use, at most 2 GB; 0: no pool);
// release_output_pool() gives them all back.
constexpr size_t kPoolMinBytes = size_t(32) << 20;

// The memory this process may use: the RAM, or its cgroup's limit where lower.
size_t usable_memory() {
  size_t bytes = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    unsigned long long limit = 0;
    if (f >> limit && limit > 0) bytes = std::min<size_t>(bytes, limit);  // "max" (no limit) fails to parse
  }
  return bytes;
}

size_t pool_cap() {
  const size_t fallback = std::min(usable_memory() / 8, size_t(2) << 30);
  const char* env = std::getenv("AMXOPT_OUTPUT_POOL_MB");
  if (!env) return fallback;
  char* end = nullptr;
  const long long mb = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || mb < 0 || mb > (1LL << 30)) {
    TORCH_WARN("amxopt: AMXOPT_OUTPUT_POOL_MB='", env, "' is not a size in MB; using ", fallback >> 20);
    return fallback;
  }
  return size_t(mb) << 20;
}

class OutputPool final : public c10::Allocator {
 public:
  OutputPool() : cap_(pool_cap()) {
    // A fork (amxopt captures in a forked child) must not copy the lock held by another thread.
    pthread_atfork([] { pool().m_.lock(); }, [] { pool().m_.unlock(); }, [] { pool().m_.unlock(); });
  }
  static OutputPool& pool() {
    static OutputPool* p = new OutputPool;  // never destroyed: outputs may outlive static destructors
    return *p;
  }
  // Off where the cap is 0, or while switched off (set_output_pool_enabled: benchmarks compare a
  // model with and without the pool in one process). Switched off, new outputs bypass the pool, which
  // keeps what it holds (for the calls after it is switched on again) and takes back its outputs.
  bool enabled() const { return cap_ > 0 && on_.load(std::memory_order_relaxed); }
  bool set_on(bool on) { return on_.exchange(on); }
  c10::DataPtr allocate(size_t n) override {
    // A storage resized below the pool's sizes (resize_ allocates through its allocator) takes ATen's.
    if (n < kPoolMinBytes) return c10::GetCPUAllocator()->allocate(n);
    void* p = take(n);
    return {p, p, &give_back, c10::Device(c10::DeviceType::CPU)};  // context == data, as ATen's own
  }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
  void release() {
    std::list<std::pair<void*, size_t>> blocks;
    {
      std::lock_guard<std::mutex> g(m_);
      blocks.swap(free_);
      held_ = 0;
    }
    for (auto& [p, n] : blocks) ::operator delete(p, std::align_val_t{kHuge});
  }
  size_t held() {
    std::lock_guard<std::mutex> g(m_);
    return held_;
  }

 private:
  void* take(size_t n) {
    {
      std::lock_guard<std::mutex> g(m_);
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second == n) {
          void* p = it->first;
          free_.erase(it);
          held_ -= n;
          sizes_[p] = n;
          return p;
        }
    }
    void* p = nullptr;
    try {
      p = ::operator new(n, std::align_val_t{kHuge});
    } catch (const std::bad_alloc&) {  // the pool's freed outputs first, then once more
      release();
      try {
        p = ::operator new(n, std::align_val_t{kHuge});
      } catch (const std::bad_alloc&) {
        TORCH_CHECK(false, "amxopt: out of memory allocating an output of ", n, " bytes");
      }
    }
    advise_huge(p, n);
    std::lock_guard<std::mutex> g(m_);
    sizes_[p] = n;
    return p;
  }
  static void give_back(void* p) { pool().give(p); }
  // p back to the pool, the oldest freed outputs given back to the system while it holds over its cap.
  void give(void* p) {
    std::list<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard<std::mutex> g(m_);
      auto it = sizes_.find(p);
      const size_t n = it->second;
      sizes_.erase(it);
      free_.emplace_back(p, n);
      held_ += n;
      while (held_ > cap_) {
        held_ -= free_.front().second;
        evicted.splice(evicted.end(), free_, free_.begin());
      }
    }
    for (auto& [q, n] : evicted) ::operator delete(q, std::align_val_t{kHuge});
  }

  std::mutex m_;
  std::list<std::pair<void*, size_t>> free_;  // freed outputs and their sizes, oldest first
  std::unordered_map<void*, size_t> sizes_;   // outputs in use and their sizes
  size_t held_ = 0;                           // bytes in free_
  const size_t cap_;
  std::atomic<bool> on_{true};
};

}  // namespace

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t nbytes = c10::multiply_integers(sizes) * int64_t(options.dtype().itemsize());
  // at::empty fills new memory with NaN where the user asked for that (deterministic algorithms):
  // its path then, which a reused buffer would bypass.
  const auto& ctx = at::globalContext();
  const bool fill = ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory();
  if (size_t(nbytes) >= kPoolMinBytes && !fill && OutputPool::pool().enabled())
    return at::detail::empty_generic(sizes, &OutputPool::pool(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                     c10::typeMetaToScalarType(options.dtype()), options.memory_format_opt());
  auto out = at::empty(sizes, options);
  advise_huge(out.data_ptr(), out.nbytes());
  return out;
}

void release_output_pool() { OutputPool::pool().release(); }
bool set_output_pool_enabled(bool on) { return OutputPool::pool().set_on(on); }
bool output_pool_enabled() { return OutputPool::pool().enabled(); }
int64_t output_pool_bytes() { return int64_t(OutputPool::pool().held()); }

}  // namespace amxopt
