// A small thread pool for the CPU kernels: parallel_for over work units.
//
// Why not OpenMP: its idle threads spin, and on a machine whose cores are
// busy with other work (an inference engine, a trainer, other jobs) a
// spinning thread takes the core its teammate needs; on 2 shared cores,
// 2 OpenMP threads measured several times slower than 1. Here the calling
// thread always works, units are claimed one grain at a time from an atomic
// counter, and helpers sleep on a condition variable between jobs. So a
// helper that is descheduled holds up at most the grain it took, and a job
// never waits for a helper that has not started.
//
// Threads: $WSYNC_THREADS, else $OMP_NUM_THREADS, else the CPUs this process
// may run on. A second caller while a job runs (another Python thread, the
// GIL being released) runs its job inline rather than queueing. After fork()
// the child starts a fresh pool: the parent's helpers do not exist there.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace wsync {

inline int env_threads(const char* name) {
  const char* v = std::getenv(name);
  const int n = v ? std::atoi(v) : 0;
  return n > 0 ? std::min(n, 256) : 0;
}

inline int default_threads() {
  if (int n = env_threads("WSYNC_THREADS")) return n;
  if (int n = env_threads("OMP_NUM_THREADS")) return n;
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)) {}

  int threads() const { return threads_; }

  // fn(u) for every u in [0, count), grain units per claim; returns when all are done.
  void run(int64_t count, int64_t grain, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (threads_ == 1 || count <= grain || !busy.owns_lock()) {
      for (int64_t u = 0; u < count; ++u) fn(u);
      return;
    }
    start_helpers();
    {
      std::lock_guard<std::mutex> g(m_);
      job_ = &fn;
      count_ = count;
      grain_ = grain;
      next_.store(0);
      ++generation_;
    }
    wake_.notify_all();
    work(fn, count, grain);
    std::unique_lock<std::mutex> g(m_);
    done_.wait(g, [&] { return inside_ == 0; });
    job_ = nullptr;  // a helper waking late finds nothing to do
  }

 private:
  void work(const std::function<void(int64_t)>& fn, int64_t count, int64_t grain) {
    for (int64_t u0; (u0 = next_.fetch_add(grain)) < count;)
      for (int64_t u = u0; u < std::min(count, u0 + grain); ++u) fn(u);
  }

  void start_helpers() {
    if (!helpers_.empty()) return;
    for (int i = 1; i < threads_; ++i) helpers_.emplace_back([this] { helper(); });
  }

  void helper() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> g(m_);
    for (;;) {
      wake_.wait(g, [&] { return generation_ != seen; });
      seen = generation_;
      if (!job_) continue;
      const std::function<void(int64_t)>* fn = job_;
      const int64_t count = count_, grain = grain_;
      ++inside_;
      g.unlock();
      work(*fn, count, grain);
      g.lock();
      if (--inside_ == 0) done_.notify_all();
    }
  }

  const int threads_;
  std::mutex busy_;  // held by the caller whose job the helpers serve
  std::mutex m_;     // guards the job fields below and inside_
  std::condition_variable wake_, done_;
  std::vector<std::thread> helpers_;  // never joined: the pool lives until the process ends
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t count_ = 0, grain_ = 1;
  std::atomic<int64_t> next_{0};
  uint64_t generation_ = 0;
  int inside_ = 0;  // helpers running the current job
};

// The process's pool, made on first use and deliberately leaked: joining
// sleeping helpers at exit would hang, and a forked child must not touch
// the parent's (possibly locked) mutexes, so it gets a new pool instead.
inline Pool*& pool_slot() {
  static Pool* p = nullptr;
  return p;
}

inline Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(__linux__)
    pthread_atfork(nullptr, nullptr, [] { pool_slot() = new Pool(pool_slot() ? pool_slot()->threads() : 1); });
#endif
    if (!pool_slot()) pool_slot() = new Pool(default_threads());
  });
  return *pool_slot();
}

template <class F>
inline void parallel_for(int64_t count, int64_t grain, F&& f) {
  const std::function<void(int64_t)> fn = std::ref(f);
  pool().run(count, std::max<int64_t>(1, grain), fn);
}

}  // namespace wsync
