#include "segment.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "errors.h"
#include "identity.h"
#include "ndarray.h"
#include "parallel.h"
#include "stats.h"

namespace torchshm {

namespace {

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

void delete_view(void* ctx) { delete static_cast<View*>(ctx); }

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif
// Below this, one thread populates: starting threads costs more than it saves.
constexpr int64_t kMinPopulatePerThread = 16 << 20;

// Backs every data page of a new segment now, so that a memory limit fails
// here with an error instead of later, on first write; 0 or an errno.
// MADV_POPULATE_WRITE faults the pages in as writes would, and several
// threads fault in parallel (a one-off measurement, 392 MB on 2 cores:
// fallocate + MAP_POPULATE 216 ms, one thread 229 ms, two 121 ms; `python -m
// benchmarks --only born` reports it as "fresh pages"). Only the header's
// first page is touched: unused slots take no memory. Kernels before 5.14
// get posix_fallocate.
int populate_pages(int fd, void* base, size_t total, int threads) {
  const int64_t data = static_cast<int64_t>(total - kHeaderBytes);
  std::vector<int> errors(std::max(threads, 1) + 1, 0);
  std::atomic<int> next{0};
  auto* start = static_cast<char*>(base) + kHeaderBytes;
  parallel_chunks(data, threads, kMinPopulatePerThread, kPageBytes,
                  [&](int64_t begin, int64_t len) {
                    int& err = errors[next++];
                    if (::madvise(start + begin, len, MADV_POPULATE_WRITE) != 0)
                      err = errno;
                  });
  int err = 0;
  for (int e : errors) err = err ? err : e;
  if (err == EINVAL)
    return ::posix_fallocate(fd, static_cast<off_t>(kHeaderBytes),
                             static_cast<off_t>(data));
  // EFAULT: a page could not be backed (SIGBUS had it been a write).
  return err == EFAULT ? ENOMEM : err;
}

// Below this, one thread writes or compares.
constexpr int64_t kMinWritePerThread = 16 << 20;
// Below this, one thread walks the page table (Segment::take_private).
constexpr int64_t kMinScanPerThread = 64 << 20;
// Compared in blocks, so that a difference found by one thread stops the
// others soon.
constexpr int64_t kCompareBlock = 1 << 20;

// The PAGEMAP_SCAN ioctl of /proc/self/pagemap (Linux 6.7), spelled here:
// older kernel headers lack it.
struct PageRegion {
  uint64_t start, end, categories;
};
struct PagemapScan {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages,
      category_inverted, category_mask, category_anyof_mask, return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PagemapScan);
constexpr uint64_t kPageIsFile = 1 << 2, kPageIsPresent = 1 << 3,
                   kPageIsSwapped = 1 << 4;

// Whether this kernel has PAGEMAP_SCAN; it answers ENOTTY or EINVAL once.
std::atomic<bool> pagemap_scan_works{true};

// Calls f(run, bytes) for each run of pages in [p, p + n) that this process
// wrote through a MAP_PRIVATE file mapping: the page table says such a page
// is present but no longer the file's, or swapped out (only anonymous pages
// swap). The kernel finds the runs (PAGEMAP_SCAN), or, before Linux 6.7,
// this reads a word per page of /proc/self/pagemap: 7-9 ms per 400 MB
// against 5-8 ms, 2-core reference machine. Without pagemap, the whole range
// counts as written. f returns false to stop.
template <typename F>
void for_each_written_run(uint8_t* p, size_t n, F f) {
  constexpr uint64_t kPresent = 1ULL << 63, kSwapped = 1ULL << 62,
                     kFile = 1ULL << 61;
  auto* first = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(p) &
                                           ~(kPageBytes - 1));
  const size_t pages = (p + n - first + kPageBytes - 1) / kPageBytes;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    f(first, pages * kPageBytes);
    return;
  }
  const auto from = reinterpret_cast<uint64_t>(first);
  const uint64_t to = from + pages * kPageBytes;
  if (pagemap_scan_works.load()) {
    PageRegion runs[64];
    PagemapScan scan{};
    scan.size = sizeof(scan);
    scan.vec = reinterpret_cast<uint64_t>(runs);
    scan.vec_len = 64;
    // Not the file's, and present or swapped.
    scan.category_inverted = kPageIsFile;
    scan.category_mask = kPageIsFile;
    scan.category_anyof_mask = kPageIsPresent | kPageIsSwapped;
    scan.return_mask = kPageIsFile | kPageIsPresent | kPageIsSwapped;
    bool go_on = true;
    for (uint64_t at = from; at < to && go_on;) {
      scan.start = at;
      scan.end = to;
      const int got = ::ioctl(fd, kPagemapScan, &scan);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (at == from && (errno == ENOTTY || errno == EINVAL)) {
          pagemap_scan_works.store(false);
          break;  // the word-per-page way below
        }
        go_on = f(reinterpret_cast<uint8_t*>(at), to - at);
        ::close(fd);
        return;
      }
      for (int i = 0; i < got && go_on; ++i)
        go_on = f(reinterpret_cast<uint8_t*>(runs[i].start),
                  runs[i].end - runs[i].start);
      at = scan.walk_end > at ? scan.walk_end : to;
    }
    if (pagemap_scan_works.load()) {
      ::close(fd);
      return;
    }
  }
  std::vector<uint64_t> entries(std::min<size_t>(pages, 1 << 16));
  uint8_t* run = nullptr;
  bool go_on = true;
  for (size_t done = 0; done < pages && go_on;) {
    const size_t want = std::min(entries.size(), pages - done);
    const off_t at = static_cast<off_t>((from / kPageBytes + done) * 8);
    const ssize_t got = ::pread(fd, entries.data(), want * 8, at);
    if (got <= 0) {  // unreadable: count the rest as written
      if (run == nullptr) run = first + done * kPageBytes;
      done = pages;
      break;
    }
    for (size_t i = 0; i < static_cast<size_t>(got) / 8 && go_on; ++i) {
      const uint64_t e = entries[i];
      const bool written = (e & kSwapped) || ((e & kPresent) && !(e & kFile));
      uint8_t* page = first + (done + i) * kPageBytes;
      if (written && run == nullptr) run = page;
      if (!written && run != nullptr) {
        go_on = f(run, static_cast<size_t>(page - run));
        run = nullptr;
      }
    }
    done += static_cast<size_t>(got) / 8;
  }
  ::close(fd);
  if (go_on && run != nullptr)
    f(run, static_cast<size_t>(first + pages * kPageBytes - run));
}

// The expiry timer's pipe while it sleeps without a deadline, else -1.
std::atomic<int> quiet_fd{-1};

// Fds this process holds for segments it created (see close_fd).
std::atomic<int64_t> creator_fds{0};

// Segments this process created that still hold their fd.
std::mutex created_mutex;
std::vector<std::weak_ptr<Segment>> created;

// Segments this process created whose last view died while a message naming
// them was still unread: kept, with their fd, until none is (Note [Segment
// lifetime]: the keeper's death must not take them).
std::mutex in_flight_mutex;
std::vector<std::shared_ptr<Segment>> in_flight;

void remember(const std::shared_ptr<Segment>& segment) {
  std::lock_guard<std::mutex> guard(created_mutex);
  if (created.size() >= 64 && created.size() == created.capacity()) {
    created.erase(std::remove_if(created.begin(), created.end(),
                                 [](const auto& w) { return w.expired(); }),
                  created.end());
  }
  created.push_back(segment);
}

}  // namespace

Segment::Segment(std::string session, uint64_t uid, void* base,
                 size_t mapped_bytes, int64_t capacity, int fd,
                 pid_t creator_pid)
    : session_(std::move(session)),
      uid_(uid),
      base_(base),
      mapped_bytes_(mapped_bytes),
      capacity_(capacity),
      fd_(fd),
      creator_pid_(creator_pid) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, uid_);
  name_ = "torchshm:" + session_ + ":" + buf;
}

SegmentHeader* Segment::header() const {
  return static_cast<SegmentHeader*>(base_);
}

// No slot at or above the watermark was ever taken, so scans stop there
// (most segments only ever use a few low slots). take_slot raises it before
// its CAS, both seq_cst: a scan that loads it and then the slots misses only
// slots taken after the scan began, as a scan of every slot would.
int Segment::scan_end() const {
  return static_cast<int>(
      std::min<uint32_t>(header()->slots_used.load(), kSlots));
}

std::shared_ptr<Segment> Segment::create(const std::string& session,
                                         std::shared_ptr<SessionTable> table,
                                         int64_t capacity, uint64_t creator,
                                         int threads, bool populate) {
  if (capacity < 0 || capacity > std::numeric_limits<int64_t>::max() / 2 -
                                     static_cast<int64_t>(kHeaderBytes))
    throw_errno(ENOMEM, "cannot make a segment of ", capacity, " bytes");
  const size_t total = kHeaderBytes + static_cast<size_t>(capacity);
  const uint64_t uid = random_id();
  const int index = table ? table->claim(uid) : -1;
  if (table && index < 0)
    throw_errno(EMFILE, "the session has ", table->capacity(),
                " live segments, as many as its keeper may hold fds for"
                " (raise the hard limit of `ulimit -n`)");
  // What /proc/<pid>/maps shows (torchshm._tools.doctor.SEGMENT_MAPPING).
  char tag[96];
  std::snprintf(tag, sizeof tag, "torchshm-segment:%s:%d", session.c_str(),
                index);
  int fd = ::memfd_create(tag, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  void* base = MAP_FAILED;
  int err = fd < 0 ? errno : 0;
  if (!err && (::ftruncate(fd, static_cast<off_t>(total)) != 0 ||
               ::fcntl(fd, F_ADD_SEALS, kSeals) != 0))
    err = errno;
  if (!err) {
    base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = base == MAP_FAILED ? errno
          : populate         ? populate_pages(fd, base, total, threads)
                             : 0;
  }
  if (err != 0) {
    if (base != MAP_FAILED) ::munmap(base, total);
    if (fd >= 0) ::close(fd);
    if (table) table->unclaim(index, uid);
    throw_errno(err, "cannot reserve ", total, " bytes of shared memory");
  }
  // A new memfd reads as zeros: every slot is empty, generation 0.
  auto* h = static_cast<SegmentHeader*>(base);
  h->capacity = capacity;
  h->creator = creator;
  h->uid = uid;
  h->slots_used.store(1);
  h->slots[0].word.store(creator);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kSegmentMagic;
  creator_fds.fetch_add(1);
  std::shared_ptr<Segment> segment(
      new Segment(session, uid, base, total, capacity, fd, ::getpid()));
  segment->write_fill_ = !populate;
  segment->rebind(std::move(table), index);
  remember(segment);
  return segment;
}

std::shared_ptr<Segment> Segment::attach(int fd, const std::string& session,
                                         uint64_t uid) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno(errno, "fstat of a segment failed");
  // Another user's memory, or memory someone could truncate under us
  // (SIGBUS for every reader), is never mapped.
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    throw_errno(EACCES, "refusing to map segment ", uid,
                ": not a sealed memfd of this user (owner ", st.st_uid, ")");
  const size_t total = static_cast<size_t>(st.st_size);
  if (total < kHeaderBytes)
    throw_errno(EINVAL, "not a torchshm segment: ", total, " bytes");
  void* base =
      ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw_errno(errno, "mmap of a segment failed");
  auto* h = static_cast<SegmentHeader*>(base);
  int err = 0;
  if (h->magic != kSegmentMagic || h->capacity < 0 ||
      static_cast<uint64_t>(h->capacity) + kHeaderBytes != total)
    err = EINVAL;
  else if (h->uid != uid)
    err = ESTALE;  // an fd number reused for another segment
  else if (h->unlinked.load() != 0)
    err = ENOENT;
  if (err != 0) {
    ::munmap(base, total);
    throw_errno(err, "segment ", uid, " of session ", session,
                err == ENOENT ? " is gone: every process holding it let go"
                              : " is not at this place");
  }
  std::shared_ptr<Segment> segment(
      new Segment(session, uid, base, total, h->capacity, -1, 0));
  // While the fd is open: a receiver keeps none (Note [Snapshots are mapped
  // privately]).
  if (segment->snapshot()) {
    uint8_t* mine = segment->map_private(fd);
    if (mine == nullptr)
      throw_errno(errno, "private mmap of segment ", uid, " failed");
    segment->idle_private_.store(mine);
  }
  return segment;
}

Segment::~Segment() {
  ::munmap(base_, mapped_bytes_);
  const size_t data_bytes = mapped_bytes_ - kHeaderBytes;
  if (uint8_t* p = idle_private_.load()) ::munmap(p, data_bytes);
  // A walk that a forked child inherited (the parent's thread is not here).
  if (walking_ != nullptr) ::munmap(walking_, data_bytes);
  if (uint8_t* p = readonly_.load()) ::munmap(p, data_bytes);
  close_fd();
}

void Segment::fill(int64_t at, const uint8_t* src, int64_t n, int threads) {
  TORCH_CHECK(at >= 0 && n >= 0 && at <= capacity_ - n, "a copy of ", n,
              " bytes at ", at, " overflows a segment of ", capacity_);
  const int fd = fd_.load();
  if (!(write_fill_ && generation() == 0 && fd >= 0)) {
    copy_bytes(data() + at, src, n, threads);
    return;
  }
  std::atomic<int> error{0};
  parallel_chunks(n, threads, kMinWritePerThread, kPageBytes,
                  [&](int64_t begin, int64_t len) {
                    const off_t base =
                        static_cast<off_t>(kHeaderBytes + at + begin);
                    for (int64_t done = 0; done < len && !error.load();) {
                      const ssize_t w = ::pwrite(fd, src + begin + done,
                                                 len - done, base + done);
                      if (w > 0) {
                        done += w;
                      } else if (w < 0 && errno != EINTR) {
                        error.store(errno);
                      } else if (w == 0) {
                        error.store(ENOSPC);
                      }
                    }
                  });
  // ENOSPC or ENOMEM: the memory limit that populate would have met.
  if (const int err = error.load())
    throw_errno(err, "cannot write ", n, " bytes into a shared-memory segment");
}

bool Segment::equals(int64_t at, const uint8_t* src, int64_t n,
                     int threads) const {
  if (at < 0 || n < 0 || at > capacity_ - n) return false;
  std::atomic<bool> differ{false};
  const uint8_t* mine = data() + at;
  parallel_chunks(
      n, threads, kMinWritePerThread, 1, [&](int64_t begin, int64_t len) {
        for (int64_t done = 0; done < len && !differ.load();) {
          const int64_t step = std::min(kCompareBlock, len - done);
          if (std::memcmp(mine + begin + done, src + begin + done, step) != 0)
            differ.store(true);
          done += step;
        }
      });
  return !differ.load();
}

void Segment::mark_snapshot() { header()->snapshot.store(1); }

bool Segment::snapshot() const { return header()->snapshot.load() != 0; }

uint8_t* Segment::map_private(int fd) const {
  void* p =
      ::mmap(nullptr, mapped_bytes_ - kHeaderBytes, PROT_READ | PROT_WRITE,
             MAP_PRIVATE, fd, static_cast<off_t>(kHeaderBytes));
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

uint8_t* Segment::mapping(Mapping kind) {
  if (kind == Mapping::kShared) return data();
  TORCH_CHECK(kind == Mapping::kReadOnly, "a private mapping is taken");
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  if (readonly_.load() == nullptr) {
    // A second mapping of the same pages, without an fd (old_size 0
    // duplicates a shared mapping), then made read-only.
    const size_t n = mapped_bytes_ - kHeaderBytes;
    void* p = ::mremap(data(), 0, n, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) return nullptr;
    if (::mprotect(p, n, PROT_READ) != 0) {
      ::munmap(p, n);
      return nullptr;
    }
    readonly_.store(static_cast<uint8_t*>(p));
  }
  return readonly_.load();
}

void Segment::drop_written(uint8_t* data, int threads) {
  count(kPrivateMappingsWalked);
  // The mapping reads the segment's pages again where this process wrote
  // (MADV_DONTNEED on a private file mapping). All of it: a view's .base
  // tensor spans the whole data, not only its arrays.
  parallel_chunks(capacity_, threads, kMinScanPerThread, kPageBytes,
                  [&](int64_t begin, int64_t len) {
                    for_each_written_run(data + begin, static_cast<size_t>(len),
                                         [](uint8_t* run, size_t bytes) {
                                           ::madvise(run, bytes, MADV_DONTNEED);
                                           return true;
                                         });
                  });
}

uint8_t* Segment::take_private(int threads) {
  uint8_t* idle = nullptr;
  bool written = false;
  {
    std::unique_lock<std::mutex> guard(mappings_mutex_);
    // This process's walk ends soon; a walk of another (the parent's, in a
    // forked child) never will here: that mapping is walked now instead.
    walked_.wait(guard, [&] {
      return walking_ == nullptr || walking_pid_ != ::getpid() ||
             idle_private_.load() != nullptr;
    });
    idle = idle_private_.exchange(nullptr);
    written = idle_written_;
    if (idle == nullptr && walking_ != nullptr) {
      idle = std::exchange(walking_, nullptr);
      written = true;
    }
  }
  if (idle != nullptr) {
    if (written) drop_written(idle, threads);
    return idle;
  }
  const int fd = fd_.load();
  return fd >= 0 ? map_private(fd) : nullptr;
}

bool Segment::private_ready() const {
  if (idle_private_.load() != nullptr || fd_.load() >= 0) return true;
  std::lock_guard<std::mutex> guard(mappings_mutex_);
  return walking_ != nullptr;
}

void Segment::give_back_private(uint8_t* data, bool written) {
  uint8_t* walked = nullptr;
  {
    std::lock_guard<std::mutex> guard(mappings_mutex_);
    if (idle_private_.load() == nullptr && walking_ == nullptr) {
      if (!written) {
        idle_written_ = false;
        idle_private_.store(data);
        return;
      }
      walked = walking_ = std::exchange(data, nullptr);
      walking_pid_ = ::getpid();
    }
  }
  if (data != nullptr) {  // one mapping is kept, idle or being walked
    ::munmap(data, mapped_bytes_ - kHeaderBytes);
    return;
  }
  // Off the receiver's path: the next message over this segment waits for
  // the walk only if it comes before the walk is done. A thread named as
  // Note [Threads at fork] asks; where none can start, the walk runs here.
  const bool started =
      start_detached_worker([self = shared_from_this(), walked] {
        self->drop_written(walked, 1);
        self->walk_done(walked);
      });
  if (!started) {
    drop_written(walked, 1);
    walk_done(walked);
  }
}

void Segment::walk_done(uint8_t* data) {
  {
    std::lock_guard<std::mutex> guard(mappings_mutex_);
    if (walking_ != data) return;  // taken meanwhile (walked there too)
    walking_ = nullptr;
    if (idle_private_.load() == nullptr) {
      idle_written_ = false;
      idle_private_.store(data);
      data = nullptr;
    }
  }
  walked_.notify_all();
  if (data != nullptr) ::munmap(data, mapped_bytes_ - kHeaderBytes);
}

void Segment::adopt_private(Segment& other) {
  TORCH_CHECK(other.uid_ == uid_ && other.mapped_bytes_ == mapped_bytes_,
              "expected another mapping of segment ", name_, ", got ",
              other.name_);
  if (uint8_t* p = other.idle_private_.exchange(nullptr))
    give_back_private(p, /*written=*/false);
}

WriteWatch WriteWatch::now() {
  struct rusage usage;
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return WriteWatch{};
  return WriteWatch{::getpid(), usage.ru_minflt + usage.ru_majflt};
}

bool WriteWatch::unchanged() const {
  if (faults < 0) return false;
  const WriteWatch later = now();
  return later.pid == pid && later.faults == faults;
}

bool written_privately(const View* view, int64_t lo, int64_t hi) {
  if (view->private_data == nullptr || hi <= lo || view->lent.unchanged())
    return false;
  bool written = false;
  for_each_written_run(view->private_data + lo, static_cast<size_t>(hi - lo),
                       [&](uint8_t*, size_t) {
                         written = true;
                         return false;
                       });
  return written;
}

void Segment::close_fd() {
  const int fd = fd_.exchange(-1);
  if (fd < 0) return;
  ::close(fd);
  // Only a creator's segment holds an fd after its constructor returns.
  creator_fds.fetch_sub(1);
}

int64_t open_creator_fds() { return creator_fds.load(); }

void wake_when_quiet(int fd) { quiet_fd.store(fd); }

void Segment::rebind(std::shared_ptr<SessionTable> table, int index) {
  std::atomic_store(&table_, std::move(table));
  index_.store(index);
}

std::shared_ptr<SessionTable> Segment::table() const {
  return std::atomic_load(&table_);
}

std::string Segment::locator() const {
  const int fd = fd_.load();
  return name_ + ":" + std::to_string(index_.load()) + ":" +
         std::to_string(fd >= 0 ? creator_pid_ : 0) + ":" + std::to_string(fd);
}

int Segment::take_slot(uint64_t holder) {
  SegmentHeader* h = header();
  for (int i = 0; i < kSlots; ++i) {
    if (h->slots[i].word.load() != 0) continue;
    uint32_t used = h->slots_used.load();
    const uint32_t wanted = static_cast<uint32_t>(i) + 1;
    while (used < wanted &&
           !h->slots_used.compare_exchange_weak(used, wanted)) {
    }
    // A ticket names its own slot (layout.h).
    const uint64_t word =
        holder & kTicketBit
            ? (holder & ~(kTicketSlotMask << kTicketSlotShift)) |
                  (static_cast<uint64_t>(i) << kTicketSlotShift)
            : holder;
    uint64_t expected = 0;
    if (h->slots[i].word.compare_exchange_strong(expected, word)) return i;
  }
  return -1;
}

void Segment::release_slot(int slot, uint64_t holder) {
  if (slot < 0 || slot >= kSlots) return;
  uint64_t expected = holder;
  if (!header()->slots[slot].word.compare_exchange_strong(expected, 0)) return;
  // A pinned segment may be named by messages that hold no slot: only the
  // keeper closes it, when its session ends. A scan can be torn (a holder
  // sending it on puts the message's ticket in a lower slot, then lets go of
  // its own, higher one, while the scan passes between them): the ticket
  // stays, so a second scan finds it.
  if (!pinned() && !has_live_holder() && !has_live_holder()) unlink();
}

uint64_t Segment::issue_ticket(uint64_t channel, uint64_t writer) {
  const uint64_t nonce = random_id() & kTicketNonceMask;
  const uint64_t wanted =
      kTicketBit | (writer ? kWritingBit : 0) | (nonce ? nonce : 1);
  const int slot = take_slot(wanted);
  if (slot < 0) {
    pin();
    return 0;
  }
  Slot& s = header()->slots[slot];
  const uint64_t ticket = s.word.load();
  // A reader may see the previous ticket's channel or writer for an
  // instant; the keeper judges a ticket only after seeing the same word at
  // two scans.
  s.channel.store(channel);
  s.writer.store(writer);
  // After the ticket: the keeper clears a flag before it looks (table.h).
  if (channel != 0 || writer != 0) {
    if (auto table = this->table()) table->flag(index(), kFlagTickets);
  }
  return ticket;
}

void Segment::name_channel(uint64_t ticket, uint64_t channel) {
  Slot* s = ticket_slot(ticket);
  // Only the writer calls this, before its message's first byte is written:
  // nobody can have claimed the ticket, so the slot is still this ticket's.
  if (s == nullptr || s->word.load() != ticket) return;
  s->channel.store(channel);
  if (auto table = this->table()) table->flag(index(), kFlagTickets);
}

Slot* Segment::ticket_slot(uint64_t ticket) const {
  if (!(ticket & kTicketBit)) return nullptr;
  const uint64_t slot = (ticket >> kTicketSlotShift) & kTicketSlotMask;
  return slot < static_cast<uint64_t>(kSlots) ? &header()->slots[slot]
                                              : nullptr;
}

int Segment::claim_ticket(uint64_t ticket, uint64_t holder) {
  Slot* s = ticket_slot(ticket);
  if (s == nullptr) return -1;
  const uint64_t id = ticket & ~kWritingBit;
  // A ticket the keeper found dead is not claimed: the load goes the way
  // of a second load (a fresh slot and the generation check).
  if (s->verdict.load() == id) return -1;
  uint64_t word = s->word.load();
  while ((word & ~kWritingBit) == id) {
    if (s->word.compare_exchange_weak(word, holder))
      return static_cast<int>(s - header()->slots);
  }
  return -1;
}

bool Segment::cancel_ticket(uint64_t ticket) {
  Slot* s = ticket_slot(ticket);
  if (s == nullptr) return false;
  const uint64_t id = ticket & ~kWritingBit;
  uint64_t word = s->word.load();
  while ((word & ~kWritingBit) == id) {
    if (s->word.compare_exchange_weak(word, 0)) return true;
  }
  return false;
}

bool Segment::mark_written(uint64_t ticket) {
  Slot* s = ticket_slot(ticket);
  if (s == nullptr) return false;
  uint64_t expected = ticket | kWritingBit;
  return s->word.compare_exchange_strong(expected, ticket & ~kWritingBit);
}

bool Segment::has_live_holder(int except_slot) {
  Slot* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    uint64_t word = slots[i].word.load();
    if (i == except_slot || word == 0) continue;
    // A ticket the keeper found dead (its pipe is closed everywhere, or its
    // writer died mid-write). A receiver that claimed it first turned the
    // word into its own id, so this CAS then fails and the receiver keeps
    // its slot.
    const bool dead_ticket =
        (word & kTicketBit) && slots[i].verdict.load() == (word & ~kWritingBit);
    if (!dead_ticket && holder_alive(word)) return true;
    slots[i].word.compare_exchange_strong(word, 0);  // a dead holder's slot
  }
  return false;
}

bool Segment::has_ticket_in_flight() const {
  const Slot* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    const uint64_t word = slots[i].word.load();
    if ((word & kTicketBit) && slots[i].verdict.load() != (word & ~kWritingBit))
      return true;
  }
  return false;
}

bool Segment::reserve_for_reuse(int own_slot) {
  if (views_.load() != 0 || pinned() || has_live_holder(own_slot)) return false;
  header()->generation.fetch_add(1);
  header()->snapshot.store(0);  // whoever takes it next says what it is
  return !has_live_holder(own_slot) && !pinned();
}

void Segment::pin() { header()->pinned.store(1); }

void Segment::unlink() {
  if (header()->unlinked.exchange(1) != 0) return;
  // After the change it announces (table.h).
  if (auto table = this->table()) table->flag(index(), kFlagReleased);
  close_fd();
}

uint8_t* Segment::data() const {
  return static_cast<uint8_t*>(base_) + kHeaderBytes;
}

uint64_t Segment::generation() const { return header()->generation.load(); }

bool Segment::unlinked() const { return header()->unlinked.load() != 0; }

bool Segment::pinned() const { return header()->pinned.load() != 0; }

int64_t Segment::holders() const {
  int64_t n = 0;
  for (int i = 0, end = scan_end(); i < end; ++i)
    n += header()->slots[i].word.load() != 0;
  return n;
}

View::View(std::shared_ptr<Segment> seg, int slot_, uint64_t holder_,
           Segment::Mapping kind_, at::Storage keep_, uint8_t* private_data_)
    : segment(std::move(seg)),
      kind(kind_),
      keep(std::move(keep_)),
      private_data(private_data_),
      lent(private_data_ != nullptr ? WriteWatch::now() : WriteWatch{}),
      slot(slot_),
      holder(holder_),
      pid(current_pid()) {
  segment->views_.fetch_add(1);
  if (private_data != nullptr) segment->private_views_.fetch_add(1);
}

View::~View() {
  if (private_data != nullptr) {
    segment->give_back_private(private_data, !lent.unchanged());
    segment->private_views_.fetch_sub(1);
  }
  disown();
  if (segment->views_.fetch_sub(1) != 1) return;
  if (!segment->pooled.load()) {
    // A creator's last view: its messages in flight keep it (and its fd).
    if (segment->fd() < 0 || segment->unlinked() ||
        !segment->has_ticket_in_flight())
      return;
    std::lock_guard<std::mutex> guard(in_flight_mutex);
    in_flight.push_back(segment);
  }
  const int fd = quiet_fd.exchange(-1);
  if (fd >= 0 && ::write(fd, "q", 1) < 0) {
    // A full pipe already wakes the timer.
  }
}

void View::disown() {
  // A forked child that never adopted (fork without torchshm's hooks) must
  // not release the parent's slot.
  if (pid.load() != current_pid()) return;
  const int s = slot.exchange(-1);
  if (s >= 0) segment->release_slot(s, holder.load());
}

void View::adopt(int slot_, uint64_t holder_) {
  holder.store(holder_);
  pid.store(current_pid());
  slot.store(slot_);
}

View& View::slot_owner() {
  View* owner = keep ? view_of(keep) : nullptr;
  return owner ? *owner : *this;
}

View* view_of(const at::Storage& storage) {
  if (!storage) return nullptr;
  return storage.data_ptr().cast_context<View>(&delete_view);
}

View* view_of(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return nullptr;
  return view_of(tensor.storage());
}

at::Tensor tensor_of(at::Storage storage) {
  const int64_t n = static_cast<int64_t>(storage.nbytes());
  // What at::empty + set_ make, without two trips through the dispatcher
  // (one is made per message).
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::Make<int8_t>());
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

namespace {

at::Tensor tensor_over(View* view, uint8_t* data, int64_t n) {
  at::DataPtr ptr(data, view, &delete_view, at::Device(at::kCPU));
  return tensor_of(at::Storage(at::Storage::use_byte_size_t(), n,
                               std::move(ptr), /*allocator=*/nullptr,
                               /*resizable=*/false));
}

}  // namespace

at::Tensor view_tensor(std::shared_ptr<Segment> segment, int slot,
                       uint64_t holder) {
  const int64_t n = segment->capacity();
  uint8_t* data = segment->data();
  return tensor_over(new View(std::move(segment), slot, holder), data, n);
}

at::Tensor mapped_tensor(const at::Tensor& owner, Segment::Mapping kind,
                         int threads) {
  View* view = view_of(owner);
  TORCH_CHECK(view != nullptr, "expected a tensor over a torchshm segment");
  if (view->kind == kind) return owner;
  const at::Storage keep = view->keep ? view->keep : owner.storage();
  if (kind == Segment::Mapping::kShared) return tensor_of(keep);
  const auto& segment = view->segment;
  uint8_t* mine = nullptr;
  uint8_t* data = kind == Segment::Mapping::kPrivate
                      ? (mine = segment->take_private(threads))
                      : segment->mapping(kind);
  if (data == nullptr) return at::Tensor();
  return tensor_over(new View(segment, -1, 0, kind, keep, mine), data,
                     segment->capacity());
}

py::object mapped_object(py::handle owner, Segment::Mapping kind, int threads) {
  const at::Tensor& tensor = THPVariable_Unpack(owner.ptr());
  const at::Tensor mapped = mapped_tensor(tensor, kind, threads);
  if (!mapped.defined()) return py::none();
  if (mapped.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl())
    return py::reinterpret_borrow<py::object>(owner);
  py::object alias = py::cast(mapped);
  static const py::str kOwner("_torchshm_owner");
  alias.attr(kOwner) = owner;
  return alias;
}

py::object message_owner(py::handle owner, int threads) {
  View* view = view_of(THPVariable_Unpack(owner.ptr()));
  TORCH_CHECK(view != nullptr, "expected a tensor over a torchshm segment");
  if (view->segment->snapshot()) {
    py::object mine = mapped_object(owner, Segment::Mapping::kPrivate, threads);
    if (!mine.is_none()) return mine;
  }
  return py::reinterpret_borrow<py::object>(owner);
}

int64_t prune_in_flight() {
  std::vector<std::shared_ptr<Segment>> done;  // destroyed outside the lock
  std::lock_guard<std::mutex> guard(in_flight_mutex);
  auto still = std::partition(
      in_flight.begin(), in_flight.end(), [](const auto& segment) {
        return !segment->unlinked() && segment->has_ticket_in_flight();
      });
  done.assign(std::make_move_iterator(still),
              std::make_move_iterator(in_flight.end()));
  in_flight.erase(still, in_flight.end());
  return static_cast<int64_t>(in_flight.size());
}

int64_t in_flight_count() {
  std::lock_guard<std::mutex> guard(in_flight_mutex);
  return static_cast<int64_t>(in_flight.size());
}

std::vector<std::shared_ptr<Segment>> segments_with_fd() {
  std::lock_guard<std::mutex> guard(created_mutex);
  std::vector<std::shared_ptr<Segment>> out;
  for (const auto& weak : created) {
    auto segment = weak.lock();
    if (segment && segment->fd() >= 0) out.push_back(std::move(segment));
  }
  return out;
}

}  // namespace torchshm
