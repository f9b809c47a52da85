/* A fake CUDA runtime (libfakecudart.so) for testing the core's CUDA shim without a GPU.
 *
 * It exports the runtime entry points the shim resolves, with the same ABI (cudaError_t as a
 * 32-bit int, streams and events as opaque pointers) and semantics close enough to catch the
 * bugs that matter: cudaHostRegister refuses a page that is already registered, cudaEventQuery
 * answers cudaErrorNotReady while an event's work is "running", failures set the per-process
 * last error that cudaGetLastError returns and clears.
 *
 * Control API (C linkage, plain C types, so tests reach it with dlsym and Python with ctypes):
 *   fake_cudart_reset()                      counters, failure modes, register log -> zero
 *   fake_cudart_calls()                      calls of any runtime entry point since reset
 *   fake_cudart_register_calls()             cudaHostRegister calls (failed ones included)
 *   fake_cudart_unregister_calls()           cudaHostUnregister calls
 *   fake_cudart_register_count(p, n)         how often exactly [p, p+n) was registered
 *   fake_cudart_is_registered(p, n)          1 if every byte of [p, p+n) is registered now
 *   fake_cudart_registered_bytes()           bytes registered now
 *   fake_cudart_registered_ranges()          ranges registered now
 *   fake_cudart_last_register_flags()        flags of the latest cudaHostRegister
 *   fake_cudart_fail_register(err)           0: succeed; else every register returns err
 *   fake_cudart_set_register_delay_us(us)    sleep inside cudaHostRegister (widens races)
 *   fake_cudart_hold_events(hold)            1: recorded events stay pending until completed
 *   fake_cudart_complete_all()               every recorded event completes
 *   fake_cudart_set_event_complete(ev, c)    one event completes (c=1) or is pending (c=0)
 *   fake_cudart_fail_event_record(err)       0: succeed; else cudaEventRecord returns err
 *   fake_cudart_fail_event_query(err)        0: normal; else cudaEventQuery returns err
 *   fake_cudart_live_events()                events created and not destroyed
 *   fake_cudart_events_created()             cudaEventCreateWithFlags successes since reset
 *   fake_cudart_event_records()              cudaEventRecord calls since reset
 *   fake_cudart_last_record_stream()         stream of the latest cudaEventRecord
 *   fake_cudart_last_event_flags()           flags of the latest cudaEventCreateWithFlags
 *   fake_cudart_peek_last_error()            the last error, without clearing it
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define FAKE_API __attribute__((visibility("default")))

typedef int cudaError_t;
typedef void* cudaStream_t;
typedef struct fake_event* cudaEvent_t;

enum {
  kSuccess = 0,
  kErrorInvalidValue = 1,
  kErrorInvalidResourceHandle = 400,
  kErrorNotReady = 600,
  kErrorHostMemoryAlreadyRegistered = 712,
  kErrorHostMemoryNotRegistered = 713,
};

#define FAKE_EVENT_MAGIC 0x6576656eu /* "even" */

struct fake_event {
  unsigned magic;
  int recorded;
  int complete;
  unsigned flags;
  struct fake_event* next; /* live list */
};

struct range {
  uintptr_t start;
  size_t len;
  int live;        /* registered now */
  long long times; /* how often exactly this range was registered */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static long long g_calls, g_register_calls, g_unregister_calls;
static long long g_events_created, g_event_records;
static int g_fail_register, g_fail_record, g_fail_query, g_hold_events, g_delay_us;
static unsigned g_last_register_flags, g_last_event_flags;
static void* g_last_record_stream;
static cudaError_t g_last_error;
static struct range* g_ranges;
static size_t g_nranges, g_cap;
static struct fake_event* g_events;
static long long g_live_events;

/* Every entry point counts itself and runs under the one lock. */
static void enter(void) {
  pthread_mutex_lock(&g_mu);
  ++g_calls;
}

static cudaError_t leave(cudaError_t err) {
  if (err != kSuccess) g_last_error = err;
  pthread_mutex_unlock(&g_mu);
  return err;
}

static struct range* find_exact(uintptr_t start, size_t len) {
  for (size_t i = 0; i < g_nranges; ++i) {
    if (g_ranges[i].start == start && g_ranges[i].len == len) return &g_ranges[i];
  }
  return NULL;
}

static const uintptr_t kPage = 4096;

/* Like the driver, refuse a range that shares a page with a registered one. */
static int overlaps_live_pages(uintptr_t start, size_t len) {
  uintptr_t lo = start & ~(kPage - 1);
  uintptr_t hi = (start + len + kPage - 1) & ~(kPage - 1);
  for (size_t i = 0; i < g_nranges; ++i) {
    if (!g_ranges[i].live) continue;
    uintptr_t rlo = g_ranges[i].start & ~(kPage - 1);
    uintptr_t rhi = (g_ranges[i].start + g_ranges[i].len + kPage - 1) & ~(kPage - 1);
    if (lo < rhi && rlo < hi) return 1;
  }
  return 0;
}

static int valid_event(cudaEvent_t ev) {
  for (struct fake_event* e = g_events; e != NULL; e = e->next) {
    if (e == ev) return e->magic == FAKE_EVENT_MAGIC;
  }
  return 0;
}

/* ---- runtime entry points ---- */

FAKE_API cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  int delay;
  pthread_mutex_lock(&g_mu);
  delay = g_delay_us;
  pthread_mutex_unlock(&g_mu);
  if (delay > 0) {
    struct timespec ts = {delay / 1000000, (long)(delay % 1000000) * 1000};
    nanosleep(&ts, NULL);
  }
  enter();
  ++g_register_calls;
  g_last_register_flags = flags;
  if (ptr == NULL || size == 0) return leave(kErrorInvalidValue);
  if (g_fail_register != 0) return leave(g_fail_register);
  uintptr_t start = (uintptr_t)ptr;
  if (overlaps_live_pages(start, size)) return leave(kErrorHostMemoryAlreadyRegistered);
  struct range* r = find_exact(start, size);
  if (r == NULL) {
    if (g_nranges == g_cap) {
      size_t cap = g_cap == 0 ? 64 : g_cap * 2;
      struct range* grown = (struct range*)realloc(g_ranges, cap * sizeof(*grown));
      if (grown == NULL) return leave(2 /* cudaErrorMemoryAllocation */);
      g_ranges = grown;
      g_cap = cap;
    }
    r = &g_ranges[g_nranges++];
    r->start = start;
    r->len = size;
    r->times = 0;
  }
  r->live = 1;
  ++r->times;
  return leave(kSuccess);
}

FAKE_API cudaError_t cudaHostUnregister(void* ptr) {
  enter();
  ++g_unregister_calls;
  for (size_t i = 0; i < g_nranges; ++i) {
    if (g_ranges[i].live && g_ranges[i].start == (uintptr_t)ptr) {
      g_ranges[i].live = 0;
      return leave(kSuccess);
    }
  }
  return leave(kErrorHostMemoryNotRegistered);
}

FAKE_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  enter();
  if (event == NULL) return leave(kErrorInvalidValue);
  struct fake_event* e = (struct fake_event*)calloc(1, sizeof(*e));
  if (e == NULL) return leave(2 /* cudaErrorMemoryAllocation */);
  e->magic = FAKE_EVENT_MAGIC;
  e->flags = flags;
  e->next = g_events;
  g_events = e;
  ++g_live_events;
  ++g_events_created;
  g_last_event_flags = flags;
  *event = e;
  return leave(kSuccess);
}

FAKE_API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  enter();
  ++g_event_records;
  g_last_record_stream = stream;
  if (!valid_event(event)) return leave(kErrorInvalidResourceHandle);
  if (g_fail_record != 0) return leave(g_fail_record);
  event->recorded = 1;
  event->complete = !g_hold_events;
  return leave(kSuccess);
}

FAKE_API cudaError_t cudaEventQuery(cudaEvent_t event) {
  enter();
  if (!valid_event(event)) return leave(kErrorInvalidResourceHandle);
  if (g_fail_query != 0) return leave(g_fail_query);
  /* Like the real runtime, an event never recorded stands for no work: it is complete. */
  if (event->recorded && !event->complete) return leave(kErrorNotReady);
  return leave(kSuccess);
}

FAKE_API cudaError_t cudaEventDestroy(cudaEvent_t event) {
  enter();
  for (struct fake_event** link = &g_events; *link != NULL; link = &(*link)->next) {
    if (*link == event) {
      *link = event->next;
      event->magic = 0;
      free(event);
      --g_live_events;
      return leave(kSuccess);
    }
  }
  return leave(kErrorInvalidResourceHandle);
}

FAKE_API const char* cudaGetErrorString(cudaError_t error) {
  enter();
  const char* s;
  switch (error) {
    case kSuccess:
      s = "no error";
      break;
    case kErrorInvalidValue:
      s = "invalid argument";
      break;
    case 2:
      s = "out of memory";
      break;
    case kErrorInvalidResourceHandle:
      s = "invalid resource handle";
      break;
    case kErrorNotReady:
      s = "device not ready";
      break;
    case kErrorHostMemoryAlreadyRegistered:
      s = "part or all of the requested memory range is already mapped";
      break;
    case kErrorHostMemoryNotRegistered:
      s = "pointer does not correspond to a registered memory region";
      break;
    default:
      s = "fake cudart error";
      break;
  }
  pthread_mutex_unlock(&g_mu);
  return s;
}

FAKE_API cudaError_t cudaGetLastError(void) {
  enter();
  cudaError_t err = g_last_error;
  g_last_error = kSuccess;
  pthread_mutex_unlock(&g_mu);
  return err;
}

/* ---- control API ---- */

#define LOCKED(type, expr)       \
  do {                           \
    pthread_mutex_lock(&g_mu);   \
    type value_ = (expr);        \
    pthread_mutex_unlock(&g_mu); \
    return value_;               \
  } while (0)

FAKE_API void fake_cudart_reset(void) {
  pthread_mutex_lock(&g_mu);
  g_calls = g_register_calls = g_unregister_calls = 0;
  g_events_created = g_event_records = 0;
  g_fail_register = g_fail_record = g_fail_query = g_hold_events = g_delay_us = 0;
  g_last_register_flags = g_last_event_flags = 0;
  g_last_record_stream = NULL;
  g_last_error = kSuccess;
  free(g_ranges);
  g_ranges = NULL;
  g_nranges = g_cap = 0;
  /* Live events belong to whoever created them; they stay valid across a reset. */
  pthread_mutex_unlock(&g_mu);
}

FAKE_API long long fake_cudart_calls(void) { LOCKED(long long, g_calls); }
FAKE_API long long fake_cudart_register_calls(void) { LOCKED(long long, g_register_calls); }
FAKE_API long long fake_cudart_unregister_calls(void) { LOCKED(long long, g_unregister_calls); }
FAKE_API long long fake_cudart_events_created(void) { LOCKED(long long, g_events_created); }
FAKE_API long long fake_cudart_event_records(void) { LOCKED(long long, g_event_records); }
FAKE_API long long fake_cudart_live_events(void) { LOCKED(long long, g_live_events); }
FAKE_API void* fake_cudart_last_record_stream(void) { LOCKED(void*, g_last_record_stream); }
FAKE_API unsigned fake_cudart_last_register_flags(void) { LOCKED(unsigned, g_last_register_flags); }
FAKE_API unsigned fake_cudart_last_event_flags(void) { LOCKED(unsigned, g_last_event_flags); }
FAKE_API int fake_cudart_peek_last_error(void) { LOCKED(int, g_last_error); }

FAKE_API long long fake_cudart_register_count(const void* ptr, size_t len) {
  pthread_mutex_lock(&g_mu);
  struct range* r = find_exact((uintptr_t)ptr, len);
  long long times = r == NULL ? 0 : r->times;
  pthread_mutex_unlock(&g_mu);
  return times;
}

FAKE_API int fake_cudart_is_registered(const void* ptr, size_t len) {
  pthread_mutex_lock(&g_mu);
  /* Walk forward through [ptr, ptr+len), extending coverage with any live range that starts at
     or before the covered frontier. Ranges never overlap, so one pass per step suffices. */
  uintptr_t at = (uintptr_t)ptr;
  const uintptr_t end = at + len;
  int progress = 1;
  while (at < end && progress) {
    progress = 0;
    for (size_t i = 0; i < g_nranges; ++i) {
      const struct range* r = &g_ranges[i];
      if (r->live && r->start <= at && at < r->start + r->len) {
        at = r->start + r->len;
        progress = 1;
      }
    }
  }
  int covered = at >= end;
  pthread_mutex_unlock(&g_mu);
  return covered;
}

FAKE_API size_t fake_cudart_registered_bytes(void) {
  pthread_mutex_lock(&g_mu);
  size_t total = 0;
  for (size_t i = 0; i < g_nranges; ++i) {
    if (g_ranges[i].live) total += g_ranges[i].len;
  }
  pthread_mutex_unlock(&g_mu);
  return total;
}

FAKE_API size_t fake_cudart_registered_ranges(void) {
  pthread_mutex_lock(&g_mu);
  size_t n = 0;
  for (size_t i = 0; i < g_nranges; ++i) n += g_ranges[i].live != 0;
  pthread_mutex_unlock(&g_mu);
  return n;
}

FAKE_API void fake_cudart_fail_register(int err) {
  pthread_mutex_lock(&g_mu);
  g_fail_register = err;
  pthread_mutex_unlock(&g_mu);
}

FAKE_API void fake_cudart_set_register_delay_us(int us) {
  pthread_mutex_lock(&g_mu);
  g_delay_us = us;
  pthread_mutex_unlock(&g_mu);
}

FAKE_API void fake_cudart_hold_events(int hold) {
  pthread_mutex_lock(&g_mu);
  g_hold_events = hold;
  pthread_mutex_unlock(&g_mu);
}

FAKE_API void fake_cudart_complete_all(void) {
  pthread_mutex_lock(&g_mu);
  for (struct fake_event* e = g_events; e != NULL; e = e->next) e->complete = 1;
  pthread_mutex_unlock(&g_mu);
}

FAKE_API int fake_cudart_set_event_complete(void* event, int complete) {
  pthread_mutex_lock(&g_mu);
  int ok = valid_event((cudaEvent_t)event);
  if (ok) ((cudaEvent_t)event)->complete = complete;
  pthread_mutex_unlock(&g_mu);
  return ok;
}

FAKE_API void fake_cudart_fail_event_record(int err) {
  pthread_mutex_lock(&g_mu);
  g_fail_record = err;
  pthread_mutex_unlock(&g_mu);
}

FAKE_API void fake_cudart_fail_event_query(int err) {
  pthread_mutex_lock(&g_mu);
  g_fail_query = err;
  pthread_mutex_unlock(&g_mu);
}
