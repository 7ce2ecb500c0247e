/* Flags in shared memory for the ranks of one tensor-parallel instance on one host (engine/parallel/shm.py).
 *
 * A flag is one 64-byte line: a 32-bit sequence number its owner rank raises (tp_post) and a count of the
 * ranks sleeping on it. tp_wait spins on the flags it needs (pause, then sched_yield) for spin_ns, then
 * sleeps on the sequence word with FUTEX_WAIT (shared, not private: the words live in a memfd every rank
 * maps) in 50 ms slices, checking the abort word and the deadline between slices. tp_abort raises the abort
 * word and wakes every sleeper. Sequence numbers wrap: "reached" compares their difference as a signed 32-bit
 * value. Release stores and acquire loads order the data a rank writes before posting with the reads of the
 * rank that waits for it. tp_all_reduce runs a whole all-reduce (every piece of it) in C: the Python version
 * of the same steps cost ~50 us per decode row in interpreter overhead alone. Built by
 * engine/model/kernels/build.py (build_library) with -O3; called through ctypes, which releases the GIL.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int32_t seq;
    int32_t waiters;
    char pad[56];
} tp_flag;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int reached(int32_t value, int32_t target) {
    return (int32_t)((uint32_t)value - (uint32_t)target) >= 0;
}

static void futex_wake_all(int32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void tp_post(tp_flag *flag, int32_t value) {
    __atomic_store_n(&flag->seq, value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&flag->waiters, __ATOMIC_SEQ_CST) > 0)
        futex_wake_all(&flag->seq);
}

void tp_abort(int32_t *abort_word, tp_flag *flags, int64_t num_flags) {
    __atomic_store_n(abort_word, 1, __ATOMIC_SEQ_CST);
    for (int64_t i = 0; i < num_flags; i++)
        futex_wake_all(&flags[i].seq);
}

/* Wait until flags[i] reached target for every bit i of mask. Returns 0 when they all did, 1 when the abort
 * word was raised first, 2 when timeout_ns (< 0: none) passed first. */
int tp_wait(tp_flag *flags, uint64_t mask, int32_t target, const int32_t *abort_word, int64_t spin_ns,
            int64_t timeout_ns) {
    int64_t start = now_ns();
    for (int i = 0; i < 64; i++) {
        if (!((mask >> i) & 1))
            continue;
        tp_flag *f = &flags[i];
        int64_t polls = 0;
        while (!reached(__atomic_load_n(&f->seq, __ATOMIC_ACQUIRE), target)) {
            if (__atomic_load_n(abort_word, __ATOMIC_ACQUIRE))
                return 1;
            if ((++polls & 63) != 0) {
                cpu_relax();
                continue;
            }
            int64_t waited = now_ns() - start;
            if (timeout_ns >= 0 && waited > timeout_ns)
                return 2;
            if (waited < spin_ns) {
                if (waited > 20000)   /* past 20 us: let other threads of this core run between polls */
                    sched_yield();
                continue;
            }
            __atomic_fetch_add(&f->waiters, 1, __ATOMIC_SEQ_CST);
            int32_t value = __atomic_load_n(&f->seq, __ATOMIC_SEQ_CST);
            if (!reached(value, target) && !__atomic_load_n(abort_word, __ATOMIC_SEQ_CST)) {
                struct timespec slice = {0, 50 * 1000 * 1000};
                syscall(SYS_futex, &f->seq, FUTEX_WAIT, value, &slice, NULL, 0);
            }
            __atomic_fetch_sub(&f->waiters, 1, __ATOMIC_SEQ_CST);
        }
    }
    if (__atomic_load_n(abort_word, __ATOMIC_ACQUIRE))
        return 1;
    return 0;
}

/* The region as one rank sees it (engine/parallel/shm.py builds it): flags, slots and the wait policy. */
typedef struct {
    tp_flag *arrive;          /* [world] */
    tp_flag *done;            /* [world] */
    int32_t *abort_word;
    char *data;               /* slot (r, p) at data + (2 * r + p) * buffer_bytes */
    int64_t buffer_bytes;
    int64_t rank;
    int64_t world;
    int64_t spin_ns;
    int64_t timeout_ns;
} tp_ctx;

static inline char *slot(const tp_ctx *c, int64_t rank, int32_t seq) {
    return c->data + (2 * rank + ((uint32_t)seq & 1)) * c->buffer_bytes;
}

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = { (uint32_t)v << 16 };
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, NaN kept quiet (as torch) */
    union { float f; uint32_t u; } c = { f };
    if ((c.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static void sum_f32(const tp_ctx *c, int32_t seq, float *out, int64_t n) {
    const float *s0 = (const float *)slot(c, 0, seq), *s1 = (const float *)slot(c, 1, seq);
    for (int64_t i = 0; i < n; i++)
        out[i] = s0[i] + s1[i];
    for (int64_t r = 2; r < c->world; r++) {
        const float *s = (const float *)slot(c, r, seq);
        for (int64_t i = 0; i < n; i++)
            out[i] += s[i];
    }
}

static void sum_bf16(const tp_ctx *c, int32_t seq, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float acc = bf16_to_f32(((const uint16_t *)slot(c, 0, seq))[i]);
        for (int64_t r = 1; r < c->world; r++)
            acc += bf16_to_f32(((const uint16_t *)slot(c, r, seq))[i]);
        out[i] = f32_to_bf16(acc);
    }
}

/* Sum x[count] (dtype 0: float32, 1: bfloat16) over the ranks in place, summed in rank order on every rank,
 * as operations seq0 + 1, seq0 + 2, ... (one per slot-sized piece). *last_seq: the last operation used (also
 * on failure, so the caller's count stays in step until it aborts). *wait_ns: time spent waiting. Returns 0,
 * or tp_wait's 1 (aborted) / 2 (timed out). */
int tp_all_reduce(const tp_ctx *c, int32_t seq0, void *x, int64_t count, int64_t dtype, int32_t *last_seq,
                  int64_t *wait_ns) {
    int64_t item = dtype == 0 ? 4 : 2, per = c->buffer_bytes / item;
    uint64_t others = 0;
    for (int64_t r = 0; r < c->world; r++)
        if (r != c->rank)
            others |= 1ull << r;
    int32_t seq = seq0;
    *wait_ns = 0;
    for (int64_t a = 0; a < count; a += per) {
        int64_t n = count - a < per ? count - a : per;
        char *piece = (char *)x + a * item;
        seq = (int32_t)((uint32_t)seq + 1u);
        *last_seq = seq;
        int64_t t0 = now_ns();
        int rc = tp_wait(c->done, others, (int32_t)((uint32_t)seq - 2u), c->abort_word, c->spin_ns,
                         c->timeout_ns);
        *wait_ns += now_ns() - t0;
        if (rc)
            return rc;
        memcpy(slot(c, c->rank, seq), piece, (size_t)(n * item));
        tp_post(&c->arrive[c->rank], seq);
        t0 = now_ns();
        rc = tp_wait(c->arrive, others, seq, c->abort_word, c->spin_ns, c->timeout_ns);
        *wait_ns += now_ns() - t0;
        if (rc)
            return rc;
        if (dtype == 0)
            sum_f32(c, seq, (float *)piece, n);
        else
            sum_bf16(c, seq, (uint16_t *)piece, n);
        tp_post(&c->done[c->rank], seq);
    }
    return 0;
}
