// A segment's memfd: created sealed, filled (fresh_pages.h or a copy), attached
// by a receiver, unlinked and closed. Its holder slots are in
// segment_holders.cpp, its private and read-only mappings in
// segment_private.cpp, the views tensors hold in views.cpp.
#include "lifetime/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
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

#include "base/errors.h"
#include "base/ndarray.h"
#include "base/parallel.h"
#include "lifetime/fork_guard.h"
#include "lifetime/fresh_pages.h"
#include "lifetime/identity.h"

namespace torchshm {

namespace {

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// Note [Kept fds above select's range] (segment.h).
int kept_above_select_range(int fd) {
  const int high = ::fcntl(fd, F_DUPFD_CLOEXEC, kKeptFdsFrom);
  if (high < 0) return fd;  // EINVAL: the soft limit is kKeptFdsFrom or less
  ::close(fd);
  return high;
}

// What a lost segment's questions read (Segment::header): unlinked, no
// slot taken. Zero pages until the first lost segment asks; never freed.
SegmentHeader* lost_header() {
  static SegmentHeader* header = [] {
    auto* h = new SegmentHeader{};
    h->unlinked.store(1);
    return h;
  }();
  return header;
}

// Below this, one thread compares.
constexpr int64_t kMinComparePerThread = 16 << 20;

// Compared in blocks, so that a difference found by one thread stops the
// others soon.
constexpr int64_t kCompareBlock = 1 << 20;

// Fds this process holds for segments it created (see close_fd).
std::atomic<int64_t> creator_fds{0};

// Segments this process created that still hold their fd.
std::mutex created_mutex;
std::vector<std::weak_ptr<Segment>> created;

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
      creator_pid_(creator_pid),
      epoch_(mapping_epoch()) {
  track_mapping(base_, mapped_bytes_);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, uid_);
  name_ = "torchshm:" + session_ + ":" + buf;
}

SegmentHeader* Segment::header() const {
  // In the child of a fork torchshm did not prepare the header is not
  // mapped (Note [Forks torchshm did not prepare] in fork_guard.h): every
  // question then reads "unlinked, held by nobody", and no answer or
  // release there touches what the parent still uses.
  if (lost()) return lost_header();
  return static_cast<SegmentHeader*>(base_);
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
  if (fd >= 0) fd = kept_above_select_range(fd);
  void* base = MAP_FAILED;
  int err = fd < 0 ? errno : 0;
  if (!err && (::ftruncate(fd, static_cast<off_t>(total)) != 0 ||
               ::fcntl(fd, F_ADD_SEALS, kSeals) != 0))
    err = errno;
  if (!err) {
    base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    // Only the data is populated, and of the header only the page written
    // below: unused slots take no memory.
    err = base == MAP_FAILED ? errno
          : populate
              ? populate_pages(fd, static_cast<uint8_t*>(base), kHeaderBytes,
                               total - kHeaderBytes, threads)
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
  // privately]). A snapshot's messages need it; shared memory's read-only
  // arrays do (readonly_mapping), and it costs no page until then.
  uint8_t* mine = segment->map_private(fd);
  if (mine == nullptr)
    throw_errno(errno, "private mmap of segment ", uid, " failed");
  segment->idle_private_.store(mine);
  return segment;
}

Segment::~Segment() {
  // unmap_tracked: none of these is unmapped in the child of a fork
  // torchshm did not prepare (fork_guard.h).
  unmap_tracked(base_, mapped_bytes_);
  const size_t data_bytes = mapped_bytes_ - kHeaderBytes;
  if (uint8_t* p = idle_private_.load()) unmap_tracked(p, data_bytes);
  // A walk that a forked child inherited (the parent's thread is not here).
  if (walking_ != nullptr) unmap_tracked(walking_, data_bytes);
  if (readonly_ != nullptr) unmap_tracked(readonly_, data_bytes);
  if (parked_ != nullptr) unmap_tracked(parked_, capacity_);
  close_fd();
}

bool Segment::lost() const { return epoch_ != mapping_epoch(); }

void Segment::fill(int64_t at, const uint8_t* src, int64_t n, int threads) {
  TORCH_CHECK(at >= 0 && n >= 0 && at <= capacity_ - n, "a copy of ", n,
              " bytes at ", at, " overflows a segment of ", capacity_);
  const int fd = fd_.load();
  if (!(write_fill_ && generation() == 0 && fd >= 0)) {
    copy_bytes(data() + at, src, n, threads);
    return;
  }
  const size_t offset = kHeaderBytes + static_cast<size_t>(at);
  if (const int err = fill_fresh_pages(fd, static_cast<uint8_t*>(base_), offset,
                                       src, static_cast<size_t>(n), threads))
    throw_errno(err, "cannot write ", n, " bytes into a shared-memory segment");
}

bool Segment::equals(int64_t at, const uint8_t* src, int64_t n,
                     int threads) const {
  if (at < 0 || n < 0 || at > capacity_ - n) return false;
  std::atomic<bool> differ{false};
  const uint8_t* mine = data() + at;
  parallel_chunks(
      n, threads, kMinComparePerThread, 1, [&](int64_t begin, int64_t len) {
        for (int64_t done = 0; done < len && !differ.load();) {
          const int64_t step = std::min(kCompareBlock, len - done);
          if (std::memcmp(mine + begin + done, src + begin + done, step) != 0)
            differ.store(true);
          done += step;
        }
      });
  return !differ.load();
}

void Segment::close_fd() {
  const int fd = fd_.exchange(-1);
  if (fd < 0) return;
  ::close(fd);
  // Only a creator's segment holds an fd after its constructor returns.
  creator_fds.fetch_sub(1);
}

int64_t open_creator_fds() { return creator_fds.load(); }

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

void Segment::pin() { header()->pinned.store(1); }

void Segment::unlink() {
  if (header()->unlinked.exchange(1) != 0) return;
  // After the change it announces (table.h).
  if (auto table = this->table()) table->flag(index(), kFlagReleased);
  close_fd();
}

bool Segment::created_here() const {
  return creator_pid_ != 0 && creator_pid_ == current_pid();
}

uint8_t* Segment::data() const {
  return static_cast<uint8_t*>(base_) + kHeaderBytes;
}

uint64_t Segment::generation() const { return header()->generation.load(); }

bool Segment::unlinked() const { return header()->unlinked.load() != 0; }

bool Segment::pinned() const { return header()->pinned.load() != 0; }

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
