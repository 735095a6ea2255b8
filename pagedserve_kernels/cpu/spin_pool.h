// A fork-join pool for the CPU kernels whose workers spin briefly before they sleep.
//
// Why not at::parallel_for (OpenMP): the engine core runs OpenMP with OMP_WAIT_POLICY=PASSIVE,
// so that its idle threads never steal the CPU from the HTTP frontend or a neighbour (with
// spinning OpenMP threads a many-client load ran several times slower). But then every
// parallel region wakes the other thread from a futex, and a one-client decode step runs
// ~150 regions: those wake-ups cost a large share of the step (the figures:
// docs/performance.md, "Figures behind choices in the code"). This pool's workers spin
// for 100 us after their last job -- long enough to bridge the Python between two
// kernels of one forward pass, short enough that an idle engine sleeps -- and then wait
// on a futex (C++20 atomic wait). PAGEDSERVE_SPIN_US (read once per process) sets that
// time; 0 makes the workers sleep at once, as PASSIVE OpenMP does.
//
// Work is claimed, not assigned: a job is cut into a few chunks per thread and the caller
// and the workers take chunks one at a time until none are left. The caller waits only
// for chunks a worker has already taken. So when another process holds the other core and
// a worker is not running, the caller does the whole job itself instead of waiting for the
// worker to be scheduled (with fixed shares a small call beside a busy process waited for
// the descheduled worker, dozens of times its own work).
//
// Contract: parallel_for(begin, end, grain, fn) calls fn(b, e) on disjoint ranges of at
// least `grain` items (but the last) covering [begin, end), possibly several per thread,
// and returns when all are done. One caller at a time: a second concurrent caller (or a
// call from inside fn) runs its loop inline. After a fork the child builds its own workers.
// fn must not throw (a worker cannot pass an exception back): the kernels check their
// inputs before they fork.

#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

namespace pagedserve {

// Forks this process has gone through, as the child sees it: bumped in each fork's child
// (pthread_atfork), where a pool built before the fork has no workers. Read on every
// parallel_for instead of comparing getpid() (a system call, ~7% of a one-client decode
// step of the default model at ~150 calls a step).
inline std::atomic<uint64_t>& fork_count() {
  static std::atomic<uint64_t> count{0};
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { fork_count().fetch_add(1, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  return count;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

class SpinPool {
 public:
  static constexpr int64_t kDefaultSpinMicros = 100;

  // The process's pool, sized to torch's thread count at first use (minus the caller).
  static SpinPool& get() {
    static std::atomic<SpinPool*> pool{nullptr};
    SpinPool* current = pool.load(std::memory_order_acquire);
    const uint64_t forks = fork_count().load(std::memory_order_relaxed);
    if (current == nullptr || current->forks_ != forks) {
      static std::mutex create;
      std::lock_guard<std::mutex> lock(create);
      current = pool.load(std::memory_order_acquire);
      if (current == nullptr || current->forks_ != forks) {
        // Never deleted: workers live as long as the process (no exit-time join).
        current = new SpinPool(std::max(0, at::get_num_threads() - 1));
        pool.store(current, std::memory_order_release);
      }
    }
    return *current;
  }

  static constexpr int64_t kChunksPerThread = 4;

  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
    const int64_t total = end - begin;
    if (total <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    const int64_t max_threads = std::min<int64_t>(num_workers_ + 1, at::get_num_threads());
    const int64_t threads = std::min<int64_t>(max_threads, (total + grain - 1) / grain);
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (threads <= 1 || !busy.owns_lock()) {
      fn(begin, end);
      return;
    }
    // Chunks of `chunk` items, claimed in order by whoever is running.
    // Example: 100 items, grain 16, 2 threads -> 7 chunks of 16 (the last 4):
    // [0, 16), [16, 32), ..., [96, 100).
    const int64_t num_chunks = std::min<int64_t>(threads * kChunksPerThread,
                                                 (total + grain - 1) / grain);
    const int64_t chunk = (total + num_chunks - 1) / num_chunks;
    const int64_t chunks = (total + chunk - 1) / chunk;
    const std::function<void(int64_t)> job = [&](int64_t index) {
      const int64_t b = begin + index * chunk;
      fn(b, std::min(end, b + chunk));
    };
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    active_workers_.store(threads - 1, std::memory_order_relaxed);
    claims_.store(pack(generation, chunks, 0), std::memory_order_release);
    // seq_cst here and in wait_for_change (a Dekker pair): either this sees the sleeper
    // and wakes it, or the sleeper's wait sees the new generation and does not sleep.
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
    run_chunks(generation);
    // Chunks a worker took are still running: wait for them (yield if it was descheduled).
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 4096) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    job_ = nullptr;
  }

 private:
  explicit SpinPool(int num_workers)
      : num_workers_(num_workers), forks_(fork_count().load(std::memory_order_relaxed)),
        spin_micros_(spin_micros_from_env()) {
    for (int i = 0; i < num_workers; ++i) std::thread([this, i] { worker_loop(i); }).detach();
  }

  // claims_ = generation (low 32 bits) << 32 | number of chunks << 16 | next chunk.
  static uint64_t pack(uint64_t generation, int64_t chunks, int64_t next) {
    return (generation & 0xFFFFFFFFu) << 32 | static_cast<uint64_t>(chunks) << 16 |
           static_cast<uint64_t>(next);
  }

  // Take and run chunks of job `generation` until none are left or it is not the
  // current job any more (a worker that woke late). A chunk taken keeps its job alive:
  // the caller returns only when every chunk is done.
  void run_chunks(uint64_t generation) {
    uint64_t seen = claims_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t chunks = (seen >> 16) & 0xFFFF, next = seen & 0xFFFF;
      if ((seen >> 32) != (generation & 0xFFFFFFFFu) || next >= chunks) return;
      if (!claims_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;  // `seen` now holds the current value
      (*job_)(next);
      done_.fetch_add(1, std::memory_order_acq_rel);
      seen = claims_.load(std::memory_order_acquire);
    }
  }

  void worker_loop(int index) {
    // Generation 0 is the pool's start: a job published before this thread first runs
    // is generation 1 and must not be taken as already seen.
    uint64_t seen = 0;
    for (;;) {
      seen = wait_for_change(seen);
      if (index < active_workers_.load(std::memory_order_relaxed)) run_chunks(seen);
    }
  }

  static int64_t spin_micros_from_env() {
    const char* value = std::getenv("PAGEDSERVE_SPIN_US");
    if (value == nullptr || *value == '\0') return kDefaultSpinMicros;
    return std::max<int64_t>(0, std::atoll(value));
  }

  // Spin up to spin_micros_ for a new generation, then sleep until one comes.
  uint64_t wait_for_change(uint64_t seen) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::microseconds(spin_micros_);
    for (int i = 0; spin_micros_ > 0; ++i) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      cpu_relax();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      generation_.wait(seen, std::memory_order_seq_cst);
      const uint64_t now = generation_.load(std::memory_order_seq_cst);
      if (now != seen) {
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        return now;
      }
    }
  }

  const int num_workers_;
  const uint64_t forks_;  // fork_count() when built: another value means a forked child
  const int64_t spin_micros_;
  std::mutex busy_;
  const std::function<void(int64_t)>* job_ = nullptr;
  std::atomic<int64_t> active_workers_{0}, done_{0};
  std::atomic<uint64_t> claims_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
};

// at::parallel_for's signature, on the spinning pool.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  SpinPool::get().parallel_for(begin, end, grain, fn);
}

}  // namespace pagedserve
