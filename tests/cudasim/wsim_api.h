// The C API of a wsim build: the kernel registry, launches, guarded argument buffers.
// Included once, after the .cu sources and a WSIM_KERNELS(X) list (written by the build).
#pragma once

static const ::wsim::Kernel wsim_kernels[] = {WSIM_KERNELS(WSIM_KERNEL_ENTRY){nullptr, nullptr, nullptr, 0, nullptr}};
static const int wsim_nkernels = int(sizeof wsim_kernels / sizeof wsim_kernels[0]) - 1;

WSIM_API int wsim_kernel_count() { return wsim_nkernels; }
WSIM_API const char* wsim_kernel_name(int k) { return k >= 0 && k < wsim_nkernels ? wsim_kernels[k].name : nullptr; }
WSIM_API int wsim_kernel_nparams(int k) { return wsim_kernels[k].nparams; }
// size, is_ptr, pointee size, pointee is const
WSIM_API void wsim_kernel_param(int k, int p, int* out) {
    const ::wsim::Param& q = wsim_kernels[k].params[p];
    out[0] = q.size;
    out[1] = q.is_ptr;
    out[2] = q.pointee;
    out[3] = q.is_const;
}
WSIM_API int wsim_sanitized() { return WSIM_ASAN; }

namespace wsim {

constexpr std::size_t ALT_STACK = 1 << 16;

static void install_fault_handlers() {
    if (!G.alt_stack) G.alt_stack = static_cast<char*>(std::malloc(ALT_STACK));
    stack_t ss;
    ss.ss_sp = G.alt_stack;
    ss.ss_size = ALT_STACK;
    ss.ss_flags = 0;
    sigaltstack(&ss, &G.old_alt);
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &G.old_segv);
    sigaction(SIGBUS, &sa, &G.old_bus);
}

static void remove_fault_handlers() {
    sigaction(SIGSEGV, &G.old_segv, nullptr);
    sigaction(SIGBUS, &G.old_bus, nullptr);
    if (G.old_alt.ss_sp || !(G.old_alt.ss_flags & SS_DISABLE)) sigaltstack(&G.old_alt, nullptr);
    else {
        stack_t off;
        std::memset(&off, 0, sizeof off);
        off.ss_flags = SS_DISABLE;
        sigaltstack(&off, nullptr);
    }
}

}  // namespace wsim

// Run kernel k over grid x block threads under a schedule. Returns 0, or 1 with msg set.
WSIM_API int wsim_launch(int k, const unsigned* grid, const unsigned* block, void** argv, int sched,
                         unsigned long long seed, char* msg, int msglen) {
    using namespace wsim;
    G.failed = false;
    G.msg[0] = 0;
    if (k < 0 || k >= wsim_nkernels) {
        set_msg("no kernel #%d", k);
    } else if (!grid[0] || !grid[1] || !grid[2] || !block[0] || !block[1] || !block[2]) {
        set_msg("invalid configuration: grid (%u,%u,%u), block (%u,%u,%u) (CUDA refuses empty launches)", grid[0],
                grid[1], grid[2], block[0], block[1], block[2]);
    } else if (u64(block[0]) * block[1] * block[2] > u64(MAX_THREADS)) {
        set_msg("invalid configuration: block (%u,%u,%u) has more than %d threads", block[0], block[1], block[2],
                MAX_THREADS);
    }
    if (G.failed) {
        std::snprintf(msg, std::size_t(msglen), "%s", G.msg);
        return 1;
    }
    G.kernel = &wsim_kernels[k];
    G.argv = argv;
    G.grid = uint3{grid[0], grid[1], grid[2]};
    G.block = uint3{block[0], block[1], block[2]};
    G.grid_dim = dim3(grid[0], grid[1], grid[2]);
    G.block_dim = dim3(block[0], block[1], block[2]);
    G.nthreads = block[0] * block[1] * block[2];
    G.nwarps = (G.nthreads + 31) / 32;
    G.sched = sched;
    G.rng = seed;
    const std::size_t stack = (WSIM_ASAN ? 256 : 64) * 1024;
    if (!ensure_stacks(G.nthreads, stack)) {
        std::snprintf(msg, std::size_t(msglen), "cannot map %u fiber stacks", G.nthreads);
        return 1;
    }
    tls_anchor = 1;
    (void)tls_anchor;
    int found = 0;
    G.tls_data = nullptr;
    G.tls_size = 0;
    dl_iterate_phdr(find_tls, &found);
    const u64 nblocks = u64(grid[0]) * grid[1] * grid[2];
    u64* order = static_cast<u64*>(std::malloc(sizeof(u64) * nblocks));
    order_blocks(order, nblocks);
    install_fault_handlers();
    G.in_launch = true;
    if (sigsetjmp(G.fault_jmp, 1) == 0) {
        for (u64 i = 0; i < nblocks && !G.failed; ++i) {
            const u64 b = order[i];
            G.block_idx = uint3{unsigned(b % grid[0]), unsigned((b / grid[0]) % grid[1]),
                                unsigned(b / (u64(grid[0]) * grid[1]))};
            run_block();
        }
    } else {
#if WSIM_ASAN
        // The fault left ASan believing we are on a fiber's stack; we are back on ours.
        __sanitizer_start_switch_fiber(nullptr, G.main_bottom, G.main_size);
        __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    }
    G.in_launch = false;
    remove_fault_handlers();
    std::free(order);
    G.cur = nullptr;
    std::snprintf(msg, std::size_t(msglen), "%s", G.msg);
    return G.failed ? 1 : 0;
}

// An argument buffer of n bytes whose data starts at misalign (mod 16) like the
// array it stands for, with junk around it and, without ASan, unmapped pages
// right around that (under ASan, malloc's redzones end it byte-exactly).
WSIM_API void* wsim_alloc(std::size_t n, unsigned misalign, unsigned long long seed) {
    using namespace wsim;
    misalign &= 15;
    Guard g;
#if WSIM_ASAN
    void* p = nullptr;
    if (posix_memalign(&p, 16, misalign + n)) return nullptr;
    g.base = static_cast<char*>(p);
    g.total = misalign + n;
    g.data = g.base + misalign;
#else
    const std::size_t body = (misalign + n + 16 + PAGE - 1) / PAGE * PAGE;
    g.total = body + 2 * PAGE;
    void* m = mmap(nullptr, g.total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    g.base = static_cast<char*>(m);
    char* end = g.base + PAGE + body;  // the guard page after the data
    mprotect(g.base, PAGE, PROT_NONE);
    mprotect(end, PAGE, PROT_NONE);
    const std::size_t slack = std::size_t(reinterpret_cast<std::uintptr_t>(end - n) - misalign) & 15;
    g.data = end - n - slack;
#endif
    g.n = n;
    char* lo = g.base + (WSIM_ASAN ? 0 : PAGE);
    fill_junk(lo, std::size_t(g.data - lo), seed);
#if !WSIM_ASAN
    fill_junk(g.data + n, std::size_t(g.base + g.total - PAGE - (g.data + n)), seed ^ 0x5555);
#endif
    if (G.nguards == G.cap_guards) {
        G.cap_guards = G.cap_guards ? 2 * G.cap_guards : 64;
        G.guards = static_cast<Guard*>(std::realloc(G.guards, sizeof(Guard) * std::size_t(G.cap_guards)));
    }
    G.guards[G.nguards++] = g;
    return g.data;
}

// Release a buffer from wsim_alloc: 0 if the junk around it is intact, 1 if a kernel wrote before
// its start, 2 after its end, -1 if it is not one of ours.
WSIM_API int wsim_free(void* data, unsigned long long seed) {
    using namespace wsim;
    for (int i = 0; i < G.nguards; ++i) {
        Guard g = G.guards[i];
        if (g.data != data) continue;
        G.guards[i] = G.guards[--G.nguards];
        char* lo = g.base + (WSIM_ASAN ? 0 : PAGE);
        int r = 0;
        const std::size_t head = std::size_t(g.data - lo);
        char* expect = static_cast<char*>(std::malloc(4096 + head));
        fill_junk(expect, head, seed);
        if (std::memcmp(expect, lo, head)) r = 1;
#if !WSIM_ASAN
        const std::size_t tail = std::size_t(g.base + g.total - PAGE - (g.data + g.n));
        expect = static_cast<char*>(std::realloc(expect, tail + 1));
        fill_junk(expect, tail, seed ^ 0x5555);
        if (!r && std::memcmp(expect, g.data + g.n, tail)) r = 2;
        munmap(g.base, g.total);
#else
        std::free(g.base);
#endif
        std::free(expect);
        return r;
    }
    return -1;
}
