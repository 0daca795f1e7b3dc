/* kvtier-cuda's native issuer: a whole mover call, checked, planned and issued by one C call that
 * Python makes with the GIL released (ctypes.CDLL).
 *
 * Why: a small model's call is bound by host time; Python planning and Python driver calls cost a
 * large share of its DMA time, and two threads (vLLM's saver and forward threads) issued one after
 * the other on the GIL (measurements: docs/cuda-performance.md).
 *
 * The driver's entry points come from Python as function pointers (the libcuda.so.1 that is
 * already loaded), so this file needs no CUDA header and links nothing. The kernels are the
 * Triton kernels the mover compiled and kept (kvtier.cuda.kernels): their parameter arrays are
 * written here, in the layout the driver confirmed for them.
 *
 * kvt_plan is pure (no driver): it is tested on any machine against the Python planner.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*kvt_record_fn)(void *event, void *stream);
typedef int (*kvt_wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*kvt_launch_fn)(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned shared, void *stream,
                             void **params, void **extra);
typedef int (*kvt_dtoh_fn)(void *dst, uint64_t src, size_t nbytes, void *stream);
typedef int (*kvt_htod_fn)(uint64_t dst, const void *src, size_t nbytes, void *stream);
typedef int (*kvt_sync_fn)(void *event);
typedef int (*kvt_stream_sync_fn)(void *stream);

typedef struct {
  kvt_record_fn record;
  kvt_wait_fn wait;
  kvt_launch_fn launch;
  kvt_dtoh_fn dtoh;
  kvt_htod_fn htod;
  kvt_sync_fn sync;
  kvt_stream_sync_fn stream_sync;
} kvt_driver;

typedef struct {
  void *function;
  void **params; /* pointers to each parameter's value */
  uint32_t block_x;
  uint32_t shared;
} kvt_kernel;

/* One direction of one mover (a lane), filled by Python (again when its buffers change). A call
 * goes in parts (kvt_issue): the kernel of one overlaps the DMAs of another. */
typedef struct {
  const kvt_driver *drv;
  void *stream;        /* the lane's copy stream */
  void *kstream;       /* the lane's kernel stream */
  void *after;         /* event: the caller's stream at the call */
  kvt_kernel ids;      /* copy_words: a store's ids, pinned host -> device */
  kvt_kernel pages;    /* the gather (store) or scatter (load) */
  uint32_t grid_y;     /* the pages kernel's programs per page */
  uint32_t layers;
  uint32_t words_block; /* copy_words' ids per program */
  const uint64_t *slots; /* staging slots, `slot_rows` rows each */
  void *const *filled; /* per slot: its part gathered (store) or copied in (load) */
  void *const *free;   /* per slot: its part copied out (store) or scattered (load) */
  int64_t nslots;
  int64_t slot_rows;
  int64_t first_rows;  /* a call larger than a slot: its first group's rows (then x4) */
  int64_t *ids_host;   /* pinned */
  uint64_t ids_dev;
  int64_t row;         /* bytes of one block's every layer */
  int64_t num_blocks;
  const uint64_t *cuts; /* where host registrations begin and end, sorted */
  int64_t ncuts;
} kvt_lane;

/* The struct's size and every field's offset, in order, for Python to check its mirror against. */
void kvt_lane_layout(int64_t *out) {
  int i = 0;
  out[i++] = (int64_t)sizeof(kvt_lane);
#define AT(f) out[i++] = (int64_t)offsetof(kvt_lane, f)
  AT(drv); AT(stream); AT(kstream); AT(after); AT(ids); AT(pages); AT(grid_y); AT(layers);
  AT(words_block); AT(slots); AT(filled); AT(free); AT(nslots); AT(slot_rows); AT(first_rows);
  AT(ids_host); AT(ids_dev); AT(row); AT(num_blocks); AT(cuts); AT(ncuts);
#undef AT
}

/* Which driver call failed (kvt_issue returns its CUresult, and sets *failed). */
enum { KVT_RECORD = 1, KVT_WAIT, KVT_LAUNCH_IDS, KVT_LAUNCH_PAGES, KVT_DTOH, KVT_HTOD, KVT_SYNC };

/* Check the block ids (-1: skip the block) of `count` transfers, transfer t's `counts[t]` ids at
 * `ids[t]` and its host object at `addrs[t]` (each block's row `row` bytes after the previous),
 * write the kept ids to `ids_out` and the runs of kept blocks back to back in host memory to `runs`
 * (host address, first kept index, blocks: at most one triple per block). Returns the kept count
 * and sets *nruns; or -1 when an id is below -1 or at least `num_blocks`, with lohi = {lowest,
 * highest} id. One pass that reads each id once: the id checked is the id written, whatever
 * another thread does to the caller's ids meanwhile (nothing is issued before this returns). */
int64_t kvt_plan(const int64_t *addrs, const int64_t *counts, int64_t count,
                 const int64_t *const *ids, int64_t row, int64_t num_blocks, int64_t *ids_out,
                 int64_t *runs, int64_t *nruns, int64_t *lohi) {
  int64_t lo = INT64_MAX, hi = INT64_MIN, k = 0, r = 0, next = -1;
  for (int64_t t = 0; t < count; t++) {
    for (int64_t j = 0; j < counts[t]; j++) {
      int64_t b = ids[t][j];
      if (b < lo) lo = b;
      if (b > hi) hi = b;
      if (b < 0) continue;
      int64_t host = addrs[t] + j * row;
      if (r && host == next) {
        runs[3 * (r - 1) + 2] += 1;
      } else {
        runs[3 * r] = host;
        runs[3 * r + 1] = k;
        runs[3 * r + 2] = 1;
        r++;
      }
      next = host + row;
      ids_out[k++] = b;
    }
  }
  if (lo < -1 || hi >= num_blocks) { /* false with no id at all: lo > hi */
    lohi[0] = lo;
    lohi[1] = hi;
    return -1;
  }
  *nruns = r;
  return k;
}

/* The first cut strictly above `a`. */
static int64_t first_cut_after(const kvt_lane *l, uint64_t a) {
  int64_t lo = 0, hi = l->ncuts;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (l->cuts[mid] <= a) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* The DMAs between kept rows [a, b) of the runs and the device rows from `dev` on, each split
 * where a host registration begins or ends. */
static int copies(const kvt_lane *l, const int64_t *runs, int64_t nruns, int64_t a, int64_t b,
                  uint64_t dev0, int store, int *failed) {
  const kvt_driver *d = l->drv;
  for (int64_t r = 0; r < nruns; r++) {
    int64_t k0 = runs[3 * r + 1], lo = k0 > a ? k0 : a;
    int64_t hi = k0 + runs[3 * r + 2] < b ? k0 + runs[3 * r + 2] : b;
    if (lo >= hi) continue;
    uint64_t host = (uint64_t)(runs[3 * r] + (lo - k0) * l->row);
    uint64_t dev = dev0 + (uint64_t)((lo - a) * l->row);
    uint64_t end = host + (uint64_t)((hi - lo) * l->row);
    int64_t c = l->ncuts ? first_cut_after(l, host) : 0;
    while (host < end) {
      uint64_t stop = (c < l->ncuts && l->cuts[c] < end) ? l->cuts[c++] : end;
      int res = store ? d->dtoh((void *)host, dev, stop - host, l->stream)
                      : d->htod(dev, (const void *)host, stop - host, l->stream);
      if (res) {
        *failed = store ? KVT_DTOH : KVT_HTOD;
        return res;
      }
      dev += stop - host;
      host = stop;
    }
  }
  return 0;
}

static void set_u64(void **params, int i, uint64_t v) { *(uint64_t *)params[i] = v; }
static void set_i32(void **params, int i, int32_t v) { *(int32_t *)params[i] = v; }

/* The gather (store) or scatter (load) of kept rows [first, first + count) from or into the
 * staging at `staging`, on the kernel stream (the driver copies the parameter values at the
 * launch). */
static int launch_pages(const kvt_lane *l, uint64_t staging, int64_t first, int64_t count) {
  void **p = l->pages.params; /* cache, staging, ids, layer_offsets, run_offsets, first_entry, first_layer */
  set_u64(p, 1, staging);
  set_u64(p, 2, l->ids_dev);
  set_i32(p, 5, (int32_t)first);
  set_i32(p, 6, 0);
  return l->drv->launch(l->pages.function, (unsigned)(count * l->layers), l->grid_y, 1,
                        l->pages.block_x, 1, 1, l->pages.shared, l->kstream, p, NULL);
}

/* After an error, wait for what was queued (the host objects may go once this returns). */
static int fail(const kvt_lane *l, int res) {
  l->drv->stream_sync(l->stream);
  l->drv->stream_sync(l->kstream);
  return res;
}

/* Where a call that fits one slot splits in two: the part whose kernel nothing hides (a store's
 * first gather, a load's last scatter) is about a sixteenth of the rows. One part where the
 * second would start at an address the kernel was not compiled for (rows of a size that is not
 * a multiple of 16 bytes). */
static int64_t small_part(const kvt_lane *l, int64_t n) {
  int64_t m = (n + 15) / 16;
  return n < 2 || (m * l->row) % 16 || ((n - m) * l->row) % 16 ? n : m;
}

#define CHECK(call, step)                                                                       \
  do {                                                                                         \
    if ((res = (call))) return *failed = (step), fail(l, res);                                 \
  } while (0)

/* One part: kept rows [a, b) through slot `s` at row `at`. A store's kernel stream gathers it
 * (first waiting until the slot's previous part was copied out, when `reuse`) and the copy stream
 * DMAs it out once gathered; a load's copy stream DMAs it in (after the slot's previous scatter,
 * when `reuse`) and the kernel stream scatters it once it is in. Each wait is issued right after
 * the record it waits for, so one event per slot serves every part through it. */
static int part(const kvt_lane *l, const int64_t *runs, int64_t nruns, int64_t s, int64_t at,
                int64_t a, int64_t b, int reuse, int store, int *failed) {
  const kvt_driver *d = l->drv;
  uint64_t staging = l->slots[s] + (uint64_t)(at * l->row);
  int res;
  if (store) {
    if (reuse) CHECK(d->wait(l->kstream, l->free[s], 0), KVT_WAIT);
    CHECK(launch_pages(l, staging, a, b - a), KVT_LAUNCH_PAGES);
    CHECK(d->record(l->filled[s], l->kstream), KVT_RECORD);
    CHECK(d->wait(l->stream, l->filled[s], 0), KVT_WAIT);
    if ((res = copies(l, runs, nruns, a, b, staging, 1, failed))) return fail(l, res);
    CHECK(d->record(l->free[s], l->stream), KVT_RECORD);
  } else {
    if (reuse) CHECK(d->wait(l->stream, l->free[s], 0), KVT_WAIT);
    if ((res = copies(l, runs, nruns, a, b, staging, 0, failed))) return fail(l, res);
    CHECK(d->record(l->filled[s], l->stream), KVT_RECORD);
    CHECK(d->wait(l->kstream, l->filled[s], 0), KVT_WAIT);
    CHECK(launch_pages(l, staging, a, b - a), KVT_LAUNCH_PAGES);
    CHECK(d->record(l->free[s], l->kstream), KVT_RECORD);
  }
  return 0;
}

/* A whole call of `n` kept rows, planned (kvt_plan). The kernel stream first waits for the
 * caller's stream (a store reads what it wrote; a load overwrites blocks only after its earlier
 * use of them), then a store's ids go to the device by the ids kernel, a load's by DMA. A call
 * that fits one slot goes in two parts through it; a larger one in groups through the slots in
 * turn, `first_rows` rows first, each next group four times larger up to a slot. The host waits
 * for the last part's `free` event (every earlier part is ordered before it) when `wait`. */
int kvt_issue(const kvt_lane *l, void *caller, const int64_t *runs, int64_t nruns, int64_t n,
              int store, int wait, int *failed) {
  const kvt_driver *d = l->drv;
  int res;
  if (n <= 0) return 0;
  CHECK(d->record(l->after, caller), KVT_RECORD);
  CHECK(d->wait(l->kstream, l->after, 0), KVT_WAIT);
  if (store) {
    void **p = l->ids.params; /* src, dst, start, n */
    set_u64(p, 0, (uint64_t)(uintptr_t)l->ids_host);
    set_u64(p, 1, l->ids_dev);
    set_i32(p, 2, 0);
    set_i32(p, 3, (int32_t)n);
    CHECK(d->launch(l->ids.function, (unsigned)((n + l->words_block - 1) / l->words_block), 1,
                    1, l->ids.block_x, 1, 1, l->ids.shared, l->kstream, p, NULL),
          KVT_LAUNCH_IDS);
  } else {
    CHECK(d->htod(l->ids_dev, l->ids_host, (size_t)(8 * n), l->stream), KVT_HTOD);
  }
  int64_t last = 0;
  if (n <= l->slot_rows) {
    int64_t m = store ? small_part(l, n) : n - small_part(l, n);
    if (m == 0) m = n;
    if ((res = part(l, runs, nruns, 0, 0, 0, m, 0, store, failed))) return res;
    if (m < n && (res = part(l, runs, nruns, 0, m, m, n, 0, store, failed))) return res;
  } else {
    int64_t size = l->first_rows < l->slot_rows ? l->first_rows : l->slot_rows;
    if (size < 1) size = 1;
    for (int64_t a = 0, j = 0; a < n; j++) {
      int64_t b = a + size < n ? a + size : n;
      last = j % l->nslots;
      if ((res = part(l, runs, nruns, last, 0, a, b, j >= l->nslots, store, failed))) return res;
      a = b;
      size = 4 * size < l->slot_rows ? 4 * size : l->slot_rows;
    }
  }
  if (wait && (res = d->sync(l->free[last]))) return *failed = KVT_SYNC, fail(l, res);
  return 0;
}

/* kvt_plan then kvt_issue, in one call: returns -1 (lohi set) for a bad id, else a
 * CUresult (0: done) with *failed naming the driver call. */
int64_t kvt_call(const kvt_lane *l, void *caller, int store, const int64_t *addrs,
                 const int64_t *counts, int64_t count, const int64_t *const *ids, int64_t *runs,
                 int64_t *lohi, int wait, int *failed) {
  int64_t nruns = 0;
  int64_t n = kvt_plan(addrs, counts, count, ids, l->row, l->num_blocks, l->ids_host, runs, &nruns,
                       lohi);
  if (n < 0) return -1;
  return kvt_issue(l, caller, runs, nruns, n, store, wait, failed);
}
