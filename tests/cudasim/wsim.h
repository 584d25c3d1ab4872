// wsim: CUDA device code executed on the CPU, one fiber per GPU thread.
//
// Why: a GPU is lent to almost no run of this project and CI never has one, yet
// csrc/*.cu must write the same bytes as wsync/codecs/delta_ref.py. This header
// lets g++ compile the unmodified .cu files (they are #included after it) and
// runs every GPU thread of a block as a fiber on one OS thread, switching only
// where CUDA threads can wait for each other. It is strict where the hardware is
// undefined, so a kernel that works here by luck fails loudly:
//   - __shared__ is a per-block arena (static thread_local, refilled with junk
//     at every block start, so nothing may be read before it is written);
//   - __syncthreads fails when threads reach different barriers (divergent
//     code), when a thread has exited, or when one exits while others wait;
//   - warp collectives (__shfl*_sync, __ballot_sync, __any/__all_sync,
//     __syncwarp, __reduce_*_sync) complete when the last lane of the mask
//     arrives, and fail on masks that differ between lanes, masks that leave
//     out the caller or name exited or nonexistent lanes, lanes at different
//     collectives, and shuffles that read a lane outside the mask;
//   - a block that can make no progress (a shuffle in a divergent branch)
//     fails with every thread's whereabouts;
//   - the scheduler picks the next runnable thread forward, in reverse, round
//     robin or at random (seeded), so a missing barrier shows up as a wrong
//     answer under some schedule; blocks run one at a time, in the same order;
//   - a memory fault during a launch (a guard page after an argument, a
//     fiber's stack guard) ends the launch with an error instead of the process.
// Everything is driven from Python (tests/cudasim/__init__.py) through the C
// API at the end; the build adds a registry of the kernels found in the source.
#pragma once

// System headers first: glibc's headers look at __CUDACC__, defined below.
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>  // fmaf and friends, as CUDA's device math
#include <type_traits>
#include <utility>

#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define WSIM_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define WSIM_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define WSIM_API extern "C" __attribute__((visibility("default")))

// ---- CUDA's built-in types ---------------------------------------------------------------

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace wsim {

typedef std::uint64_t u64;
typedef std::uint32_t u32;

enum Sched { SCHED_FORWARD = 0, SCHED_REVERSE = 1, SCHED_RANDOM = 2, SCHED_ROUND_ROBIN = 3 };
enum State : unsigned char { RUNNABLE, WAITING, EXITED };
enum Kind {
    K_SHFL, K_SHFL_UP, K_SHFL_DOWN, K_SHFL_XOR, K_BALLOT, K_ANY, K_ALL, K_SYNCWARP, K_REDUCE_ADD, K_REDUCE_MIN,
    K_REDUCE_MAX, K_REDUCE_AND, K_REDUCE_OR, K_REDUCE_XOR, K_NKINDS
};
static const char* const kind_names[K_NKINDS] = {
    "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync", "__any_sync",
    "__all_sync", "__syncwarp", "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync",
    "__reduce_or_sync", "__reduce_xor_sync"};
enum BarKind { B_SYNC, B_COUNT, B_AND, B_OR };
static const char* const bar_names[4] = {"__syncthreads", "__syncthreads_count", "__syncthreads_and",
                                         "__syncthreads_or"};

constexpr int MAX_THREADS = 1024;
constexpr int MAX_WARPS = MAX_THREADS / 32;
constexpr std::size_t PAGE = 4096;

struct Fiber {
    void* sp;  // saved stack pointer (x86-64) while switched out
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    char* stack_lo;  // usable stack, above its guard page
    std::size_t stack_size;
    void* asan_fake;
    uint3 tid;
    unsigned linear, lane, warp;
    State state;
    const char* wait_what;  // name of the collective or barrier it waits at
    const char* wait_site;  // file:line
    u64 result;
};

struct WarpOp {
    int kind;
    unsigned mask, arrived, width;
    const char* site;
    u64 val[32];
    int arg[32];
};

struct Warp {
    unsigned exists;  // lanes that exist (a partial last warp has fewer)
    unsigned exited;
    unsigned active;  // bit k: ops[k] is pending
    WarpOp ops[32];   // pending collectives, pairwise disjoint masks
};

struct Param {
    int size, is_ptr, pointee, is_const;
};

struct Kernel {
    const char* name;
    void* fn;
    void (*run)(void* fn, void** argv);
    int nparams;
    const Param* params;
};

struct Guard {  // an argument buffer of the current process, with guard pages and junk around it
    char* base;
    std::size_t total;
    char* data;
    std::size_t n;
};

struct Launch {
    const Kernel* kernel;
    void** argv;
    uint3 grid, block, block_idx;
    dim3 grid_dim, block_dim;
    unsigned nthreads, nwarps;
    int sched;
    u64 rng;
    Fiber* fibers;
    char* stacks;
    std::size_t stacks_bytes, stack_size;
    unsigned nfibers;  // allocated
    Fiber* cur;
    unsigned rr_next;
    unsigned exited;
    Warp warps[MAX_WARPS];
    u64 runnable[MAX_THREADS / 64];
    // the block barrier
    unsigned bar_arrived;
    int bar_kind;
    const char* bar_site;
    unsigned bar_count;
    // the scheduler's context
    void* sched_sp;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    void* sched_fake;
    const void* main_bottom;
    std::size_t main_size;
    // errors
    bool failed;
    char msg[4096];
    bool in_launch;
    sigjmp_buf fault_jmp;
    struct sigaction old_segv, old_bus;
    stack_t old_alt;
    char* alt_stack;
    // per-block shared memory: this module's TLS block on the launching thread
    char* tls_data;
    std::size_t tls_size;
    // guarded argument buffers
    Guard* guards;
    int nguards, cap_guards;
};

static Launch G;

// ---- errors ------------------------------------------------------------------------------------

static inline void yield_to_sched(bool exiting);

static inline void vset_msg(const char* fmt, va_list ap) {
    if (G.failed) return;  // the first error is the one worth reading
    G.failed = true;
    std::vsnprintf(G.msg, sizeof G.msg, fmt, ap);
}

static inline void set_msg(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset_msg(fmt, ap);
    va_end(ap);
}

// An error inside a thread: the launch stops; this fiber never runs again.
[[noreturn]] static inline void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset_msg(fmt, ap);
    va_end(ap);
    yield_to_sched(true);
    std::abort();  // not reached: a failed launch never resumes a fiber
}

static inline const char* where() {  // "block (x,y,z) thread (x,y,z)" of the running fiber
    static char buf[96];
    const Fiber* f = G.cur;
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", G.block_idx.x, G.block_idx.y,
                  G.block_idx.z, f ? f->tid.x : 0, f ? f->tid.y : 0, f ? f->tid.z : 0);
    return buf;
}

// ---- fibers ---------------------------------------------------------------------------------

#if defined(__x86_64__)
// wsim_swap(save, next): push the callee-saved registers, store rsp in *save,
// load next, pop its registers, return into it. wsim_boot starts a new fiber
// with r12 as its argument and r13 as its function (set up by fiber_init).
extern "C" void wsim_swap(void** save, void* next);
extern "C" void wsim_boot();
asm(R"(
    .text
    .p2align 4
    .hidden wsim_swap
    .type wsim_swap,@function
wsim_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size wsim_swap, .-wsim_swap
    .p2align 4
    .hidden wsim_boot
    .type wsim_boot,@function
wsim_boot:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size wsim_boot, .-wsim_boot
)");
#endif

static inline void fiber_main(void* arg);

static inline void fiber_init(Fiber* f) {
#if WSIM_ASAN
    __asan_unpoison_memory_region(f->stack_lo, f->stack_size);  // an abandoned fiber leaves poisoned frames
#endif
#if defined(__x86_64__)
    char* top = f->stack_lo + f->stack_size;  // 16-byte aligned
    void** sp = reinterpret_cast<void**>(top - 72);  // wsim_boot then runs with rsp % 16 == 0 before its call
    sp[0] = nullptr;                                   // r15
    sp[1] = nullptr;                                   // r14
    sp[2] = reinterpret_cast<void*>(&fiber_main);      // r13
    sp[3] = f;                                         // r12
    sp[4] = nullptr;                                   // rbx
    sp[5] = nullptr;                                   // rbp: ends frame-pointer unwinds
    sp[6] = reinterpret_cast<void*>(&wsim_boot);       // return address
    sp[7] = sp[8] = nullptr;
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack_lo;
    f->uc.uc_stack.ss_size = f->stack_size;
    f->uc.uc_link = nullptr;
    // makecontext passes int arguments: split the pointer
    const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(f);
    makecontext(&f->uc, reinterpret_cast<void (*)()>(+[](unsigned lo, unsigned hi) {
                    fiber_main(reinterpret_cast<void*>((std::uintptr_t(hi) << 32) | lo));
                }),
                2, unsigned(p), unsigned(p >> 32));
#endif
}

// From the scheduler into fiber f; returns when f waits, exits or fails.
static inline void run_fiber(Fiber* f) {
    G.cur = f;
#if WSIM_ASAN
    __sanitizer_start_switch_fiber(&G.sched_fake, f->stack_lo, f->stack_size);
#endif
#if defined(__x86_64__)
    wsim_swap(&G.sched_sp, f->sp);
#else
    swapcontext(&G.sched_uc, &f->uc);
#endif
#if WSIM_ASAN
    __sanitizer_finish_switch_fiber(G.sched_fake, nullptr, nullptr);
#endif
    G.cur = nullptr;
}

// From the running fiber back to the scheduler.
static inline void yield_to_sched(bool exiting) {
    Fiber* f = G.cur;
#if WSIM_ASAN
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f->asan_fake, G.main_bottom, G.main_size);
#else
    (void)exiting;
#endif
#if defined(__x86_64__)
    wsim_swap(&f->sp, G.sched_sp);
#else
    swapcontext(&f->uc, &G.sched_uc);
#endif
#if WSIM_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, nullptr, nullptr);
#endif
}

static inline void set_runnable(unsigned t) { G.runnable[t >> 6] |= u64(1) << (t & 63); }
static inline void clear_runnable(unsigned t) { G.runnable[t >> 6] &= ~(u64(1) << (t & 63)); }

static inline u64 next_rand() {  // splitmix64
    u64 z = (G.rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline int pick_thread() {
    const unsigned nw = (G.nthreads + 63) / 64;
    switch (G.sched) {
        case SCHED_REVERSE:
            for (int w = int(nw) - 1; w >= 0; --w)
                if (G.runnable[w]) return w * 64 + 63 - __builtin_clzll(G.runnable[w]);
            return -1;
        case SCHED_RANDOM: {
            unsigned total = 0;
            for (unsigned w = 0; w < nw; ++w) total += unsigned(__builtin_popcountll(G.runnable[w]));
            if (!total) return -1;
            unsigned k = unsigned(next_rand() % total);
            for (unsigned w = 0; w < nw; ++w) {
                u64 bits = G.runnable[w];
                const unsigned c = unsigned(__builtin_popcountll(bits));
                if (k >= c) {
                    k -= c;
                    continue;
                }
                while (k--) bits &= bits - 1;
                return int(w * 64 + unsigned(__builtin_ctzll(bits)));
            }
            return -1;
        }
        case SCHED_ROUND_ROBIN:
            for (unsigned i = 0; i < G.nthreads; ++i) {
                const unsigned t = (G.rr_next + i) % G.nthreads;
                if (G.runnable[t >> 6] >> (t & 63) & 1) {
                    G.rr_next = t + 1;
                    return int(t);
                }
            }
            return -1;
        default:
            for (unsigned w = 0; w < nw; ++w)
                if (G.runnable[w]) return int(w * 64 + unsigned(__builtin_ctzll(G.runnable[w])));
            return -1;
    }
}

// ---- what a stuck block looks like -----------------------------------------------------------

static inline void describe_deadlock() {
    char* out = G.msg;
    std::size_t room = sizeof G.msg;
    auto put = [&](const char* fmt, auto... a) {
        const int k = std::snprintf(out, room, fmt, a...);
        if (k > 0 && std::size_t(k) < room) {
            out += k;
            room -= std::size_t(k);
        }
    };
    G.failed = true;
    put("deadlock in block (%u,%u,%u): no thread can run (a collective or barrier some threads never reach, "
        "e.g. in a divergent branch).",
        G.block_idx.x, G.block_idx.y, G.block_idx.z);
    for (unsigned w = 0; w < G.nwarps; ++w) {
        const Warp& wp = G.warps[w];
        for (unsigned a = wp.active; a; a &= a - 1)
            if (const WarpOp& op = wp.ops[__builtin_ctz(a)]; true)
                put(" warp %u: lanes 0x%08x wait at %s (%s) with mask 0x%08x;", w, op.arrived, kind_names[op.kind],
                    op.site, op.mask);
        if (wp.exited) put(" warp %u: lanes 0x%08x exited;", w, wp.exited);
    }
    if (G.bar_arrived)
        put(" %u of %u threads wait at %s (%s).", G.bar_arrived, G.nthreads, bar_names[G.bar_kind], G.bar_site);
}

// ---- warp collectives ---------------------------------------------------------------------

static bool pow2_width(unsigned w) { return w >= 1 && w <= 32 && (w & (w - 1)) == 0; }

static inline unsigned shfl_source(int kind, unsigned lane, int arg, unsigned width) {
    const unsigned seg = lane & ~(width - 1);
    switch (kind) {
        case K_SHFL: return seg + (unsigned(arg) & (width - 1));
        case K_SHFL_UP: return (lane - seg) >= unsigned(arg) ? lane - unsigned(arg) : lane;
        case K_SHFL_DOWN: return (lane - seg) + unsigned(arg) < width ? lane + unsigned(arg) : lane;
        default: {  // xor: a later segment gives the caller its own value
            const unsigned src = lane ^ unsigned(arg);
            return (src & ~(width - 1)) > seg ? lane : src;
        }
    }
}

// Run by the last lane to arrive: every lane's result, then all of them runnable.
static inline void complete(WarpOp& op, unsigned warp) {
    Fiber* lanes = G.fibers + warp * 32;
    u64 ballot = 0, sum = 0, mn = ~u64(0), mx = 0, band = ~u64(0), bor = 0, bxor = 0;
    const bool is_signed = op.arg[__builtin_ctz(op.mask)] != 0;  // __reduce_min/max_sync of int
    for (unsigned l = 0; l < 32; ++l) {
        if (!(op.mask >> l & 1)) continue;
        const u64 v = op.val[l];
        ballot |= u64(v != 0) << l;
        sum += v;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        band &= v;
        bor |= v;
        bxor ^= v;
    }
    for (unsigned l = 0; l < 32; ++l) {
        if (!(op.mask >> l & 1)) continue;
        u64 r = 0;
        switch (op.kind) {
            case K_SHFL:
            case K_SHFL_UP:
            case K_SHFL_DOWN:
            case K_SHFL_XOR: {
                const unsigned src = shfl_source(op.kind, l, op.arg[l], op.width);
                if (src >= 32 || !(op.mask >> src & 1))
                    fail("%s at %s: lane %u of warp %u reads lane %u, which is not in the mask 0x%08x "
                         "(its value is undefined)",
                         kind_names[op.kind], op.site, l, warp, src, op.mask);
                r = op.val[src];
                break;
            }
            case K_BALLOT: r = ballot; break;
            case K_ANY: r = ballot != 0; break;
            case K_ALL: r = ballot == op.mask; break;
            case K_REDUCE_ADD: r = u32(sum); break;
            case K_REDUCE_MIN: r = is_signed ? (u32(mn) ^ 0x80000000u) : mn; break;
            case K_REDUCE_MAX: r = is_signed ? (u32(mx) ^ 0x80000000u) : mx; break;
            case K_REDUCE_AND: r = band; break;
            case K_REDUCE_OR: r = bor; break;
            case K_REDUCE_XOR: r = bxor; break;
            default: break;
        }
        lanes[l].result = r;
    }
    for (unsigned l = 0; l < 32; ++l)
        if (op.mask >> l & 1) {
            lanes[l].state = RUNNABLE;
            set_runnable(warp * 32 + l);
        }
    G.warps[warp].active &= ~(1u << unsigned(&op - G.warps[warp].ops));
}

static inline u64 warp_op(int kind, unsigned mask, u64 value, int arg, unsigned width, const char* site) {
    Fiber* f = G.cur;
    const unsigned lane = f->lane, warp = f->warp;
    Warp& w = G.warps[warp];
    const char* name = kind_names[kind];
    if (!(mask >> lane & 1))
        fail("%s at %s: %s (lane %u) calls it with mask 0x%08x, which leaves itself out", name, site, where(), lane,
             mask);
    if (mask & ~w.exists)
        fail("%s at %s: mask 0x%08x names lanes 0x%08x that do not exist (partial warp: block of %u threads)", name,
             site, mask, mask & ~w.exists, G.nthreads);
    if (mask & w.exited)
        fail("%s at %s by %s: mask 0x%08x names lanes 0x%08x that have exited", name, site, where(), mask,
             mask & w.exited);
    if (!pow2_width(width)) fail("%s at %s: width %u is not a power of two in 1..32", name, site, width);
    // Lanes meet at one call site. Collectives at other sites may be pending with overlapping
    // masks (lanes run apart between collectives); if they never resolve, the block deadlocks.
    WarpOp* op = nullptr;
    for (unsigned a = w.active; a; a &= a - 1) {
        WarpOp& o = w.ops[__builtin_ctz(a)];
        if (o.site == site && (o.mask & mask)) {
            op = &o;
            break;
        }
    }
    if (op) {
        if (op->mask != mask)
            fail("mismatched masks in warp %u: lane %u calls %s at %s with mask 0x%08x while lanes 0x%08x wait there "
                 "with mask 0x%08x",
                 warp, lane, name, site, mask, op->arrived, op->mask);
        if (op->width != width)
            fail("mismatched widths in warp %u: lane %u calls %s at %s with width %u while lanes 0x%08x wait there "
                 "with width %u",
                 warp, lane, name, site, width, op->arrived, op->width);
    } else {
        if (w.active == ~0u) fail("more than 32 collectives pending in warp %u", warp);
        const int k = __builtin_ctz(~w.active);
        w.active |= 1u << k;
        op = &w.ops[k];
        op->kind = kind;
        op->mask = mask;
        op->arrived = 0;
        op->width = width;
        op->site = site;
    }
    op->val[lane] = value;
    op->arg[lane] = arg;
    op->arrived |= 1u << lane;
    f->state = WAITING;
    f->wait_what = name;
    f->wait_site = site;
    clear_runnable(f->linear);
    if (op->arrived == mask) complete(*op, warp);
    yield_to_sched(false);
    return f->result;
}

// ---- the block barrier -------------------------------------------------------------------

static inline unsigned block_barrier(int kind, int pred, const char* site) {
    Fiber* f = G.cur;
    if (G.exited)
        fail("%s at %s by %s after %u thread(s) of the block exited (a barrier after an early return)",
             bar_names[kind], site, where(), G.exited);
    if (G.bar_arrived == 0) {
        G.bar_kind = kind;
        G.bar_site = site;
        G.bar_count = 0;
    } else if (G.bar_kind != kind || G.bar_site != site) {
        fail("divergent barriers: %s reaches %s at %s while %u thread(s) wait at %s at %s", where(), bar_names[kind],
             site, G.bar_arrived, bar_names[G.bar_kind], G.bar_site);
    }
    // A lane that another lane's pending collective waits for can never come: say so now.
    for (unsigned a = G.warps[f->warp].active; a; a &= a - 1)
        if (const WarpOp& op = G.warps[f->warp].ops[__builtin_ctz(a)]; op.mask >> f->lane & 1)
            fail("%s reaches %s at %s while lanes 0x%08x of its warp wait for it at %s (%s)", where(),
                 bar_names[kind], site, op.arrived, kind_names[op.kind], op.site);
    ++G.bar_arrived;
    G.bar_count += pred != 0;
    f->state = WAITING;
    f->wait_what = bar_names[kind];
    f->wait_site = site;
    clear_runnable(f->linear);
    if (G.bar_arrived == G.nthreads) {
        const unsigned r = kind == B_COUNT ? G.bar_count
                           : kind == B_AND ? unsigned(G.bar_count == G.nthreads)
                           : kind == B_OR  ? unsigned(G.bar_count != 0)
                                           : 0u;
        for (unsigned t = 0; t < G.nthreads; ++t) {
            G.fibers[t].state = RUNNABLE;
            G.fibers[t].result = r;
            set_runnable(t);
        }
        G.bar_arrived = 0;
    }
    yield_to_sched(false);
    return unsigned(f->result);
}

// ---- a thread ends ------------------------------------------------------------------------

[[noreturn]] static inline void thread_exit() {
    Fiber* f = G.cur;
    Warp& w = G.warps[f->warp];
    f->state = EXITED;
    clear_runnable(f->linear);
    ++G.exited;
    w.exited |= 1u << f->lane;
    if (G.bar_arrived)
        fail("%s exited while %u thread(s) wait at %s at %s (a barrier in divergent code, or an early return)",
             where(), G.bar_arrived, bar_names[G.bar_kind], G.bar_site);
    for (unsigned a = w.active; a; a &= a - 1)
        if (const WarpOp& op = w.ops[__builtin_ctz(a)]; op.mask >> f->lane & 1)
            fail("%s (lane %u) exited while lanes 0x%08x of its warp wait for it at %s (%s) with mask 0x%08x", where(),
                 f->lane, op.arrived, kind_names[op.kind], op.site, op.mask);
    yield_to_sched(true);
    std::abort();
}

static inline void fiber_main(void* arg) {
    Fiber* f = static_cast<Fiber*>(arg);
    (void)f;
#if WSIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &G.main_bottom, &G.main_size);
#endif
    G.kernel->run(G.kernel->fn, G.argv);
    thread_exit();
}

// ---- per-block shared memory: this module's TLS block ------------------------------------------

static thread_local volatile char tls_anchor;  // makes the TLS block exist on the launching thread

static inline int find_tls(struct dl_phdr_info* info, std::size_t, void* out) {
    Dl_info self;
    if (!dladdr(reinterpret_cast<void*>(&find_tls), &self)) return 0;
    if (reinterpret_cast<void*>(info->dlpi_addr) != self.dli_fbase) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i)
        if (info->dlpi_phdr[i].p_type == PT_TLS) {
            G.tls_size = info->dlpi_phdr[i].p_memsz;
            G.tls_data = static_cast<char*>(info->dlpi_tls_data);
        }
    *static_cast<int*>(out) = 1;
    return 1;
}

static inline void fill_junk(char* p, std::size_t n, u64 seed) {
    u64 s = seed;
    for (std::size_t i = 0; i < n; ++i) {
        if ((i & 7) == 0) {
            s += 0x9E3779B97F4A7C15ull;
            s = (s ^ (s >> 31)) * 0xD6E8FEB86659FD93ull;
        }
        p[i] = char(s >> (8 * (i & 7)));
    }
}

// ---- memory faults -------------------------------------------------------------------------

static inline const char* fault_place(const char* a) {
    static char buf[160];
    for (int i = 0; i < G.nguards; ++i) {
        const Guard& g = G.guards[i];
        if (a >= g.base && a < g.base + g.total) {
            std::snprintf(buf, sizeof buf, " (%+ld bytes from the start of a %zu-byte argument buffer)",
                          long(a - g.data), g.n);
            return buf;
        }
    }
    if (G.stacks && a >= G.stacks && a < G.stacks + G.stacks_bytes) return " (a fiber's stack guard: stack overflow)";
    return "";
}

static inline void on_fault(int sig, siginfo_t* si, void*) {
    if (!G.in_launch) {  // not ours: let the previous handler (or the default) have it
        sigaction(SIGSEGV, &G.old_segv, nullptr);
        sigaction(SIGBUS, &G.old_bus, nullptr);
        return;
    }
    const char* a = static_cast<const char*>(si->si_addr);
    set_msg("memory fault (%s) at %p%s in %s of %s", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", si->si_addr,
            fault_place(a), where(), G.kernel ? G.kernel->name : "?");
    G.failed = true;
    siglongjmp(G.fault_jmp, 1);
}

static inline bool ensure_stacks(unsigned n, std::size_t stack_size) {
    if (G.nfibers >= n && G.stack_size == stack_size) return true;
    if (G.stacks) munmap(G.stacks, G.stacks_bytes);
    std::free(G.fibers);
    const std::size_t per = stack_size + PAGE;
    G.stacks_bytes = per * n;
    void* m = mmap(nullptr, G.stacks_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        G.stacks = nullptr;
        G.nfibers = 0;
        return false;
    }
    G.stacks = static_cast<char*>(m);
    G.fibers = static_cast<Fiber*>(std::calloc(n, sizeof(Fiber)));
    for (unsigned i = 0; i < n; ++i) {
        mprotect(G.stacks + i * per, PAGE, PROT_NONE);  // stacks grow down into this guard
        G.fibers[i].stack_lo = G.stacks + i * per + PAGE;
        G.fibers[i].stack_size = stack_size;
    }
    G.nfibers = n;
    G.stack_size = stack_size;
    return true;
}

static inline void run_block() {
    for (unsigned w = 0; w < G.nwarps; ++w) {
        G.warps[w].exited = 0;
        G.warps[w].active = 0;
    }
    std::memset(G.runnable, 0, sizeof G.runnable);
    for (unsigned w = 0; w < G.nwarps; ++w) {
        const unsigned lanes = G.nthreads - 32 * w < 32 ? G.nthreads - 32 * w : 32;
        G.warps[w].exists = lanes == 32 ? ~0u : (1u << lanes) - 1;
    }
    G.exited = 0;
    G.bar_arrived = 0;
    G.rr_next = 0;
    if (G.tls_data) fill_junk(G.tls_data, G.tls_size, next_rand());  // __shared__ holds junk at block start
    for (unsigned t = 0; t < G.nthreads; ++t) {
        Fiber* f = &G.fibers[t];
        f->tid.x = t % G.block.x;
        f->tid.y = (t / G.block.x) % G.block.y;
        f->tid.z = t / (G.block.x * G.block.y);
        f->linear = t;
        f->lane = t & 31;
        f->warp = t >> 5;
        f->state = RUNNABLE;
        f->asan_fake = nullptr;
        fiber_init(f);
        set_runnable(t);
    }
    while (!G.failed) {
        const int t = pick_thread();
        if (t < 0) {
            if (G.exited != G.nthreads) describe_deadlock();
            return;
        }
        run_fiber(&G.fibers[t]);
    }
}

static inline void order_blocks(u64* ids, u64 n) {
    for (u64 i = 0; i < n; ++i) ids[i] = G.sched == SCHED_REVERSE ? n - 1 - i : i;
    if (G.sched == SCHED_RANDOM)
        for (u64 i = n; i > 1; --i) std::swap(ids[i - 1], ids[next_rand() % i]);
}

// ---- kernels' parameter lists --------------------------------------------------------------

template <class T> constexpr Param param_info() {
    typedef typename std::remove_pointer<T>::type P;
    typedef typename std::conditional<std::is_void<P>::value, char, P>::type Q;
    return Param{int(sizeof(T)), int(std::is_pointer<T>::value), std::is_pointer<T>::value ? int(sizeof(Q)) : 0,
                 int(std::is_const<P>::value)};
}

template <class F> struct Invoker;
template <class... A> struct Invoker<void (*)(A...)> {
    typedef void (*Fn)(A...);
    static constexpr int nparams = int(sizeof...(A));
    static constexpr Param params[sizeof...(A) ? sizeof...(A) : 1] = {param_info<A>()...};
    template <std::size_t... I> static void call(Fn f, void** argv, std::index_sequence<I...>) {
        f(*static_cast<A*>(argv[I])...);
        (void)argv;
    }
    static void run(void* f, void** argv) { call(reinterpret_cast<Fn>(f), argv, std::index_sequence_for<A...>{}); }
};

}  // namespace wsim

// ---- the CUDA names the device code uses ------------------------------------------------

#define __CUDACC__ 1
#define __CUDA_ARCH__ 900
#define __host__
#define __device__
#define __global__ __attribute__((section(".text.wsim_kernel")))
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __constant__
#define __shared__ static thread_local

#define threadIdx (static_cast<const uint3&>(::wsim::G.cur->tid))
#define blockIdx (static_cast<const uint3&>(::wsim::G.block_idx))
#define blockDim (static_cast<const dim3&>(::wsim::G.block_dim))
#define gridDim (static_cast<const dim3&>(::wsim::G.grid_dim))
#define warpSize 32

// A call site: one static per expansion, so two collectives on one line are still two sites.
#define WSIM_STR2(x) #x
#define WSIM_STR(x) WSIM_STR2(x)
#define WSIM_SITE                                                       \
    ({                                                                  \
        static const char wsim_site_[] = __FILE__ ":" WSIM_STR(__LINE__); \
        static_cast<const char*>(wsim_site_);                           \
    })

namespace wsim {
template <class T> inline u64 to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type wider than 8 bytes");
    u64 b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T from_bits(u64 b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T> inline T shfl(int kind, const char* site, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(warp_op(kind, mask, to_bits(v), arg, unsigned(width), site));
}
struct SyncWarp {  // __syncwarp() or __syncwarp(mask): the site first, then the optional mask
    const char* site;
    void operator()(unsigned mask = 0xffffffffu) const { warp_op(K_SYNCWARP, mask, 0, 0, 32, site); }
};
template <class T> inline unsigned reduce(int kind, const char* site, unsigned mask, T v) {
    static_assert(sizeof(T) == 4 && std::is_integral<T>::value, "__reduce_*_sync takes 32-bit integers");
    const u64 x = std::is_signed<T>::value && (kind == K_REDUCE_MIN || kind == K_REDUCE_MAX)
                      ? u64(u32(v) ^ 0x80000000u)  // order signed values as unsigned keys
                      : u64(u32(v));
    return unsigned(warp_op(kind, mask, x, std::is_signed<T>::value, 32, site));
}
}  // namespace wsim

#define __shfl_sync(...) ::wsim::shfl(::wsim::K_SHFL, WSIM_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) ::wsim::shfl(::wsim::K_SHFL_UP, WSIM_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) ::wsim::shfl(::wsim::K_SHFL_DOWN, WSIM_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::wsim::shfl(::wsim::K_SHFL_XOR, WSIM_SITE, __VA_ARGS__)
#define __ballot_sync(mask, p) unsigned(::wsim::warp_op(::wsim::K_BALLOT, mask, (p) != 0, 0, 32, WSIM_SITE))
#define __any_sync(mask, p) int(::wsim::warp_op(::wsim::K_ANY, mask, (p) != 0, 0, 32, WSIM_SITE))
#define __all_sync(mask, p) int(::wsim::warp_op(::wsim::K_ALL, mask, (p) != 0, 0, 32, WSIM_SITE))
#define __syncwarp(...) ::wsim::SyncWarp{WSIM_SITE}(__VA_ARGS__)
#define __reduce_add_sync(mask, v) ::wsim::reduce(::wsim::K_REDUCE_ADD, WSIM_SITE, mask, v)
#define __reduce_min_sync(mask, v) ::wsim::reduce(::wsim::K_REDUCE_MIN, WSIM_SITE, mask, v)
#define __reduce_max_sync(mask, v) ::wsim::reduce(::wsim::K_REDUCE_MAX, WSIM_SITE, mask, v)
#define __reduce_and_sync(mask, v) ::wsim::reduce(::wsim::K_REDUCE_AND, WSIM_SITE, mask, v)
#define __reduce_or_sync(mask, v) ::wsim::reduce(::wsim::K_REDUCE_OR, WSIM_SITE, mask, v)
#define __reduce_xor_sync(mask, v) ::wsim::reduce(::wsim::K_REDUCE_XOR, WSIM_SITE, mask, v)
#define __syncthreads() ((void)::wsim::block_barrier(::wsim::B_SYNC, 1, WSIM_SITE))
#define __syncthreads_count(p) int(::wsim::block_barrier(::wsim::B_COUNT, (p) != 0, WSIM_SITE))
#define __syncthreads_and(p) int(::wsim::block_barrier(::wsim::B_AND, (p) != 0, WSIM_SITE))
#define __syncthreads_or(p) int(::wsim::block_barrier(::wsim::B_OR, (p) != 0, WSIM_SITE))

// Memory ordering: one OS thread runs every fiber, so every write is seen at once.
inline void __threadfence() {}
inline void __threadfence_block() {}
template <class T> inline T __ldg(const T* p) { return *p; }

// ---- integer intrinsics ----------------------------------------------------------------------

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
    return (static_cast<unsigned long long>(__brev(unsigned(x))) << 32) | __brev(unsigned(x >> 32));
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    return unsigned((((unsigned long long)hi << 32 | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return unsigned(((unsigned long long)hi << 32 | lo) >> (s & 31));
}
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned s) {
    return s >= 32 ? lo : __funnelshift_l(lo, hi, s);
}
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned s) {
    return s >= 32 ? hi : __funnelshift_r(lo, hi, s);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned(((unsigned long long)a * b) >> 32); }
inline int __mulhi(int a, int b) { return int(((long long)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return (a > b ? a - b : b - a) + c; }

// ---- atomics (fibers never preempt each other, so a plain read-modify-write is atomic) -----------

#define WSIM_ATOMIC(NAME, EXPR)                                                   \
    template <class T> inline T NAME(T* p, T v) {                                 \
        const T old = *p;                                                         \
        *p = (EXPR);                                                              \
        return old;                                                               \
    }                                                                             \
    template <class T, class U> inline T NAME(T* p, U v) { return NAME(p, T(v)); }
WSIM_ATOMIC(atomicAdd, T(old + v))
WSIM_ATOMIC(atomicSub, T(old - v))
WSIM_ATOMIC(atomicExch, v)
WSIM_ATOMIC(atomicMin, old < v ? old : v)
WSIM_ATOMIC(atomicMax, old < v ? v : old)
WSIM_ATOMIC(atomicAnd, T(old & v))
WSIM_ATOMIC(atomicOr, T(old | v))
WSIM_ATOMIC(atomicXor, T(old ^ v))
#undef WSIM_ATOMIC
template <class T> inline T atomicCAS(T* p, T cmp, T v) {
    const T old = *p;
    if (old == cmp) *p = v;
    return old;
}
inline unsigned atomicInc(unsigned* p, unsigned lim) {
    const unsigned old = *p;
    *p = old >= lim ? 0 : old + 1;
    return old;
}
inline unsigned atomicDec(unsigned* p, unsigned lim) {
    const unsigned old = *p;
    *p = (old == 0 || old > lim) ? lim : old - 1;
    return old;
}

// ---- the C API (defined once the registry of kernels is known) ---------------------------------

#define WSIM_KERNEL_ENTRY(NAME)                                                                             \
    {#NAME, reinterpret_cast<void*>(&NAME), &::wsim::Invoker<decltype(&NAME)>::run,                          \
     ::wsim::Invoker<decltype(&NAME)>::nparams, ::wsim::Invoker<decltype(&NAME)>::params},

// The build defines WSIM_KERNELS(X) as X(name) per kernel, then includes wsim_api.h.
