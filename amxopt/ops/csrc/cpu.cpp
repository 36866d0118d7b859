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
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

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

Tier detect_tier() {
  const bool emulated = amx_emulated();  // first, so that a bad AMXOPT_EMULATE_AMX fails on every CPU
  if (has_amx() || emulated) return Tier::Amx;
  return has_avx512_bf16() ? Tier::Avx512Bf16 : Tier::Fp32;
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
// most AMXOPT_OUTPUT_POOL_MB of freed outputs (default: an eighth of the RAM, at most 4 GB; 0: no
// pool); release_output_pool() gives them back to the system.
constexpr size_t kPoolMinBytes = size_t(32) << 20;

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
  bool enabled() const { return cap_ > 0; }
  c10::DataPtr allocate(size_t n) override {
    void* p = take(n);
    return {p, new Block{p, n}, &give_back, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
  void release() {
    std::vector<std::pair<size_t, void*>> blocks;
    {
      std::lock_guard<std::mutex> g(m_);
      blocks.assign(free_.begin(), free_.end());
      free_.clear();
      held_ = 0;
    }
    for (auto& [n, p] : blocks) ::operator delete(p, std::align_val_t{kHuge});
  }
  size_t held() {
    std::lock_guard<std::mutex> g(m_);
    return held_;
  }

 private:
  struct Block {
    void* p;
    size_t n;
  };
  static size_t pool_cap() {
    if (const char* env = std::getenv("AMXOPT_OUTPUT_POOL_MB")) return size_t(std::strtoull(env, nullptr, 10)) << 20;
    const size_t ram = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
    return std::min(ram / 8, size_t(4) << 30);
  }
  void* take(size_t n) {
    {
      std::lock_guard<std::mutex> g(m_);
      if (auto it = free_.find(n); it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        held_ -= n;
        return p;
      }
    }
    void* p = ::operator new(std::max<size_t>(n, 1), std::align_val_t{kHuge});
    advise_huge(p, n);
    return p;
  }
  static void give_back(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    pool().give(b->p, b->n);
    delete b;
  }
  void give(void* p, size_t n) {
    {
      std::lock_guard<std::mutex> g(m_);
      if (held_ + n <= cap_) {
        free_.emplace(n, p);
        held_ += n;
        return;
      }
    }
    ::operator delete(p, std::align_val_t{kHuge});
  }

  std::mutex m_;
  std::multimap<size_t, void*> free_;  // freed outputs by size
  size_t held_ = 0;                    // their bytes
  const size_t cap_;
};

}  // namespace

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t nbytes = c10::multiply_integers(sizes) * int64_t(options.dtype().itemsize());
  OutputPool& pool = OutputPool::pool();
  if (size_t(nbytes) >= kPoolMinBytes && pool.enabled())
    return at::detail::empty_generic(sizes, &pool, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                     c10::typeMetaToScalarType(options.dtype()),
                                     options.memory_format_opt());
  auto out = at::empty(sizes, options);
  advise_huge(out.data_ptr(), out.nbytes());
  return out;
}

void release_output_pool() { OutputPool::pool().release(); }
int64_t output_pool_bytes() { return int64_t(OutputPool::pool().held()); }

}  // namespace amxopt
