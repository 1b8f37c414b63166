/* The event ring core (see ring.h). */
#include "ring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int64_t sw_now_ns(void) {
    struct timespec ts;
    /* CLOCK_MONOTONIC: the clock Python's time.perf_counter_ns() reads on Linux, so host
     * intervals and Python timestamps agree. */
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Make `device` current for the calling thread; returns the previous one (or -1 if unchanged). */
int sw_enter_device(const sw_runtime *rt, int device) {
    int prev = -1;
    if (rt->get_device(&prev) != SW_SUCCESS) return -1;
    if (prev == device) return -1;
    if (rt->set_device(device) != SW_SUCCESS) return -1;
    return prev;
}

/* 1: the device's primary context is active, 0: it is not, -1: cannot tell. */
static int has_context(const sw_runtime *rt, int device) {
    if (!rt->primary_ctx_get_state) return -1;
    int dev = device;
    unsigned int flags = 0;
    int active = 0;
    if (rt->device_get(&dev, device) != 0) return -1;
    if (rt->primary_ctx_get_state(dev, &flags, &active) != 0) return -1;
    return active != 0;
}

/* Give the thread its device back, but only one that has a context. Since CUDA 12,
 * cudaSetDevice initializes the device's primary context; a fresh thread (our poller) reports
 * device 0 without ever having used it, so restoring it would put a context (hundreds of MiB)
 * on GPU 0 for every rank of the node. torch restores devices the same way (c10::cuda::
 * MaybeSetDevice). When we cannot tell, the thread stays on the ring's device. */
void sw_leave_device(const sw_runtime *rt, int prev) {
    if (prev >= 0 && has_context(rt, prev) == 1) rt->set_device(prev);
}

int sw_ring_init(sw_ring *r, uint64_t cap, const sw_runtime *rt, int device, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    uint64_t n = 2;
    while (n < cap) n <<= 1;
    r->slots = calloc(n, sizeof(sw_slot));
    if (!r->slots) {
        snprintf(err, errlen, "out of memory for %llu slots", (unsigned long long)n);
        return -1;
    }
    r->cap = n;
    r->mask = n - 1;
    r->rt = rt;
    r->device = -1;
    if (!rt) return 0;

    int cur = -1;
    sw_err_t e = rt->get_device(&cur);
    if (e != SW_SUCCESS) {
        snprintf(err, errlen, "%sGetDevice failed: %s (%d)", rt->kind == SW_KIND_HIP ? "hip" : "cuda",
                 sw_runtime_strerror(rt, e), e);
        sw_ring_free(r, 0);
        return -1;
    }
    r->device = device < 0 ? cur : device;
    int prev = sw_enter_device(rt, r->device);
    for (uint64_t i = 0; i < n; i++) {
        sw_slot *s = &r->slots[i];
        e = rt->event_create_with_flags(&s->ev0, SW_EVENT_DEFAULT);
        if (e == SW_SUCCESS) e = rt->event_create_with_flags(&s->ev1, SW_EVENT_DEFAULT);
        if (e != SW_SUCCESS) {
            snprintf(err, errlen, "%sEventCreateWithFlags failed on device %d: %s (%d)",
                     rt->kind == SW_KIND_HIP ? "hip" : "cuda", r->device, sw_runtime_strerror(rt, e), e);
            sw_leave_device(rt, prev);
            sw_ring_free(r, 1);
            return -1;
        }
    }
    sw_leave_device(rt, prev);
    return 0;
}

void sw_ring_free(sw_ring *r, int destroy_events) {
    if (!r->slots) return;
    if (r->rt && destroy_events) {
        int prev = sw_enter_device(r->rt, r->device);
        for (uint64_t i = 0; i < r->cap; i++) {
            if (r->slots[i].ev0) r->rt->event_destroy(r->slots[i].ev0);
            if (r->slots[i].ev1) r->rt->event_destroy(r->slots[i].ev1);
        }
        sw_leave_device(r->rt, prev);
    }
    free(r->slots);
    r->slots = NULL;
}

static inline int capturing(const sw_ring *r, sw_stream_t stream) {
    int status = SW_CAPTURE_NONE;
    /* An error counts as capturing: on the legacy stream, StreamIsCapturing answers
     * cudaErrorStreamCaptureImplicit while a blocking stream captures, and recording there
     * would invalidate that capture. Not recording is the safe side. */
    if (r->rt->stream_is_capturing(stream, &status) != SW_SUCCESS) return 1;
    return status != SW_CAPTURE_NONE;
}

static void advance_tail(sw_ring *r) {
    while (r->tail != r->head && r->slots[r->tail & r->mask].state == SW_FREE) r->tail++;
}

int64_t sw_ring_begin(sw_ring *r, sw_stream_t stream, void *tag) {
    if (r->head - r->tail >= r->cap) {
        r->dropped++;
        return -1;
    }
    sw_slot *s = &r->slots[r->head & r->mask];
    if (r->rt) {
        /* Recording into a stream under graph capture would add a node to the user's graph
         * (and a captured event cannot be queried): skip it. */
        if (capturing(r, stream)) {
            r->captured++;
            return -1;
        }
        sw_err_t e = r->rt->event_record(s->ev0, stream);
        if (e != SW_SUCCESS) {
            r->errors++;
            r->last_error = e;
            return -1;
        }
    } else {
        s->t0 = sw_now_ns();
    }
    s->seq = r->head;
    s->state = SW_BEGUN;
    s->tag = tag;
    return (int64_t)r->head++;
}

static sw_slot *open_slot(sw_ring *r, int64_t seq) {
    if (seq < 0) return NULL;
    uint64_t u = (uint64_t)seq;
    if (u < r->tail || u >= r->head) return NULL;
    sw_slot *s = &r->slots[u & r->mask];
    if (s->seq != u || s->state != SW_BEGUN) return NULL;
    return s;
}

static void give_up(sw_ring *r, sw_slot *s, void **release) {
    *release = s->tag;
    s->tag = NULL;
    s->state = SW_FREE;
    advance_tail(r);
}

int sw_ring_end(sw_ring *r, int64_t seq, sw_stream_t stream, void **release) {
    sw_slot *s = open_slot(r, seq);
    if (!s) {
        r->bad_end++;
        return -1;
    }
    if (r->rt) {
        if (capturing(r, stream)) {
            r->captured++;
            give_up(r, s, release);
            return 1;
        }
        sw_err_t e = r->rt->event_record(s->ev1, stream);
        if (e != SW_SUCCESS) {
            r->errors++;
            r->last_error = e;
            give_up(r, s, release);
            return 1;
        }
        s->stream1 = stream;
    } else {
        s->t1 = sw_now_ns();
    }
    s->state = SW_ENDED;
    return 0;
}

int sw_ring_cancel(sw_ring *r, int64_t seq, void **release) {
    sw_slot *s = open_slot(r, seq);
    if (!s) return -1;
    give_up(r, s, release);
    return 0;
}

/* Streams seen not done in this poll: a later end event on the same stream cannot be done
 * either (work on one stream completes in order), so it is not queried. */
#define BLOCKED_MAX 8

long sw_ring_poll(sw_ring *r, sw_emit_fn emit, sw_release_fn release, void *ctx) {
    long emitted = 0;
    int prev = -1;
    sw_stream_t blocked[BLOCKED_MAX];
    int nblocked = 0;
    int mode = SW_CAPTURE_MODE_RELAXED;
    if (r->rt) {
        /* The ring's device first: any runtime call that needs a context, made before it, would
         * initialize one on the thread's default device 0. */
        prev = sw_enter_device(r->rt, r->device);
        /* Relaxed for the duration of the poll, pushed and popped as cuda_runtime_api.h
         * advises for cudaThreadExchangeStreamCaptureMode: in the default Global mode, a
         * capture running on any thread prohibits "potentially unsafe" calls such as our
         * EventQuery here, and the violation invalidates the user's capture. */
        if (r->rt->thread_exchange_capture_mode && r->rt->thread_exchange_capture_mode(&mode) != SW_SUCCESS)
            mode = -1;
    }
    for (uint64_t q = r->tail; q != r->head; q++) {
        sw_slot *s = &r->slots[q & r->mask];
        if (s->state != SW_ENDED) continue;
        double elapsed;
        if (r->rt) {
            int skip = 0;
            for (int i = 0; i < nblocked; i++) skip |= blocked[i] == s->stream1;
            if (skip) continue;
            sw_err_t e = r->rt->event_query(s->ev1);
            float ms = 0.0f;
            if (e == SW_SUCCESS) e = r->rt->event_elapsed_time(&ms, s->ev0, s->ev1);
            if (e == SW_ERR_NOT_READY) {
                if (nblocked < BLOCKED_MAX) blocked[nblocked++] = s->stream1;
                continue;
            }
            if (e != SW_SUCCESS) {
                r->errors++;
                r->last_error = e;
                void *tag = s->tag;
                s->tag = NULL;
                s->state = SW_FREE;
                release(ctx, tag);
                continue;
            }
            elapsed = (double)ms * 1e-3;
        } else {
            int64_t d = s->t1 - s->t0;
            elapsed = d > 0 ? (double)d * 1e-9 : 0.0;
        }
        if (emit(ctx, s->tag, s->seq, elapsed) != 0) {
            emitted = -1;
            break;
        }
        s->tag = NULL;
        s->state = SW_FREE;
        r->completed++;
        emitted++;
    }
    advance_tail(r);
    if (r->rt) {
        if (r->rt->thread_exchange_capture_mode && mode >= 0) r->rt->thread_exchange_capture_mode(&mode);
        sw_leave_device(r->rt, prev);
    }
    return emitted;
}

void sw_ring_clear(sw_ring *r, sw_release_fn release, void *ctx) {
    for (uint64_t q = r->tail; q != r->head; q++) {
        sw_slot *s = &r->slots[q & r->mask];
        if (s->state != SW_FREE) {
            void *tag = s->tag;
            s->tag = NULL;
            s->state = SW_FREE;
            release(ctx, tag);
        }
    }
    r->tail = r->head;
}

sw_err_t sw_event_query(const sw_runtime *rt, int device, sw_event_t ev, sw_event_t start, float *ms) {
    int prev = device >= 0 ? sw_enter_device(rt, device) : -1;
    int mode = SW_CAPTURE_MODE_RELAXED; /* as in sw_ring_poll: never invalidate a user's capture */
    if (rt->thread_exchange_capture_mode && rt->thread_exchange_capture_mode(&mode) != SW_SUCCESS) mode = -1;
    sw_err_t e = rt->event_query(ev);
    if (e == SW_SUCCESS && start) e = rt->event_elapsed_time(ms, start, ev);
    if (mode >= 0) rt->thread_exchange_capture_mode(&mode);
    sw_leave_device(rt, prev);
    return e;
}
