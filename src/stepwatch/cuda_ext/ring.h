/* The event ring: a fixed pool of timing slots shared by the host and the CUDA/HIP backends.
 *
 * A slot is taken by begin() in ring order and freed by poll() once its interval is resolved;
 * the ring never grows and a full ring drops (and counts) instead of waiting. Slots are named by
 * a sequence number (monotonic), so a stale or doubled end() is recognised and ignored.
 * poll() only ever asks non-blocking questions (EventQuery); a slot whose end event is not done
 * yet stays for the next poll.
 *
 * Plain C, no Python: the binding (module.c) owns the tags it passes in as opaque pointers.
 * Not thread-safe by itself: the binding serialises every call under the GIL.
 */
#ifndef STEPWATCH_RING_H
#define STEPWATCH_RING_H

#include <stddef.h>
#include <stdint.h>

#include "runtime.h"

enum sw_state { SW_FREE = 0, SW_BEGUN = 1, SW_ENDED = 2 };

typedef struct {
    uint64_t seq;
    int state;
    void *tag;
    int64_t t0, t1;      /* host backend: CLOCK_MONOTONIC ns */
    sw_event_t ev0, ev1; /* device backends: pre-created events */
    sw_stream_t stream1; /* stream the end event went to (poll skips streams known not done) */
} sw_slot;

typedef struct {
    sw_slot *slots;
    uint64_t cap, mask;
    uint64_t head, tail; /* seq of the next begin / oldest slot not yet freed */
    const sw_runtime *rt; /* NULL: host backend */
    int device;
    uint64_t dropped;  /* begin() found the ring full */
    uint64_t captured; /* skipped: stream was capturing a CUDA/HIP graph */
    uint64_t errors;   /* runtime call failed (the interval is lost, never raised) */
    uint64_t completed;
    uint64_t bad_end; /* end() of a slot that is not open (stale, doubled, unknown) */
    sw_err_t last_error;
} sw_ring;

/* Round `cap` up to a power of two; 0 on success, else writes why into err. Device backends
 * create 2*cap events on `device` (a negative device: the current one). */
int sw_ring_init(sw_ring *r, uint64_t cap, const sw_runtime *rt, int device, char *err, size_t errlen);

/* Free the slots; destroy_events = 0 after fork (the parent's events are not ours to destroy). */
void sw_ring_free(sw_ring *r, int destroy_events);

static inline uint64_t sw_ring_pending(const sw_ring *r) { return r->head - r->tail; }

/* -1 when nothing was recorded (ring full, stream capturing, runtime error); else the slot's seq. */
int64_t sw_ring_begin(sw_ring *r, sw_stream_t stream, void *tag);

/* Returns 0 when recorded. When the slot is given up instead (capture began in between, runtime
 * error) returns 1 and hands its tag back in *release; unknown slot: returns -1. */
int sw_ring_end(sw_ring *r, int64_t seq, sw_stream_t stream, void **release);

/* Give up an open slot (begin without end); its tag is handed back. -1 if not open. */
int sw_ring_cancel(sw_ring *r, int64_t seq, void **release);

typedef int (*sw_emit_fn)(void *ctx, void *tag, uint64_t seq, double elapsed_s);
typedef void (*sw_release_fn)(void *ctx, void *tag);

/* Emit every finished interval, oldest first, and free its slot. emit takes the tag on success
 * (returns 0); on failure (-1) polling stops and the slot stays for the next poll. Tags of
 * intervals lost to runtime errors go to release. Returns the number emitted, or -1 on emit
 * failure. */
long sw_ring_poll(sw_ring *r, sw_emit_fn emit, sw_release_fn release, void *ctx);

/* Drop every open or unresolved slot (fork reset, close); tags go to release. */
void sw_ring_clear(sw_ring *r, sw_release_fn release, void *ctx);

int64_t sw_now_ns(void);

/* Make `device` current for the calling thread: returns the previous device, or -1 when nothing
 * changed. sw_leave_device gives it back only if that device has a context (see ring.c). */
int sw_enter_device(const sw_runtime *rt, int device);
void sw_leave_device(const sw_runtime *rt, int prev);

/* Query one event (not necessarily ours: torch's too) from any thread without blocking: on
 * `device` (negative: the thread's current one), in relaxed capture mode. With `start`, also
 * the milliseconds from `start` to `ev` into *ms. SW_ERR_NOT_READY while the work runs. */
sw_err_t sw_event_query(const sw_runtime *rt, int device, sw_event_t ev, sw_event_t start, float *ms);

#endif
