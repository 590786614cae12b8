#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <vector>

#include "errors.h"
#include "identity.h"
#include "parallel.h"

namespace torchshm {

constexpr uint64_t kMagic = 0x336d687368637274ULL;  // "trchshm3"

// The layout torchshm/_reaper.py reads too (it has no native code): keep the
// offsets there in step.
struct Header {
  uint64_t magic;                          // 0, written last at creation
  int64_t capacity;                        // 8
  uint64_t creator;                        // 16
  std::atomic<uint64_t> generation;        // 24
  std::atomic<uint32_t> unlinked;          // 32
  std::atomic<uint32_t> slots_used;        // 36: see scan_end()
  uint32_t reserved[6];                    // 40
  std::atomic<uint64_t> slots[kSlots];     // 64
  std::atomic<uint64_t> channels[kSlots];  // 64 + 8 * kSlots
  std::atomic<uint64_t> verdicts[kSlots];  // 64 + 16 * kSlots
};
static_assert(sizeof(Header) <= kHeaderBytes, "header must fit its pages");
static_assert(offsetof(Header, slots) == 64, "the reaper reads slots at 64");
static_assert(offsetof(Header, slots_used) == 36, "the reaper skips it");
static_assert(offsetof(Header, verdicts) == 64 + 16 * kSlots,
              "the reaper writes verdicts there");
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "a cross-process slot must be lock-free");

namespace {

// Closes the fd on every path; the mapping outlives it.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

void delete_view(void* ctx) { delete static_cast<View*>(ctx); }

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif
// Below this, one thread populates: starting threads costs more than it saves.
constexpr int64_t kMinPopulatePerThread = 16 << 20;

// Backs every page of a new segment now, so that a full tmpfs fails here
// with an error instead of SIGBUS on first write; 0 or an errno (ENOSPC
// when tmpfs is full). MADV_POPULATE_WRITE faults the pages in as writes
// would, and several threads fault in parallel (a one-off measurement, 392
// MB on 2 cores: fallocate + MAP_POPULATE 216 ms, one thread 229 ms, two
// 121 ms; `python -m benchmarks --only born` reports it as "fresh pages").
// Kernels before 5.14 get posix_fallocate; their pages fault in on write.
int populate(int fd, void* base, size_t total, int threads) {
  std::vector<int> errors(std::max(threads, 1) + 1, 0);
  std::atomic<int> next{0};
  parallel_chunks(static_cast<int64_t>(total), threads, kMinPopulatePerThread,
                  kHeaderBytes, [&](int64_t begin, int64_t len) {
                    int& err = errors[next++];
                    if (::madvise(static_cast<char*>(base) + begin, len,
                                  MADV_POPULATE_WRITE) != 0)
                      err = errno;
                  });
  int err = 0;
  for (int e : errors) err = err ? err : e;
  if (err == EINVAL) return ::posix_fallocate(fd, 0, static_cast<off_t>(total));
  // EFAULT: a page would have raised SIGBUS, i.e. tmpfs has no room.
  return err == EFAULT ? ENOSPC : err;
}

}  // namespace

Segment::Segment(std::string name, void* base, size_t mapped_bytes,
                 int64_t capacity)
    : name_(std::move(name)),
      base_(base),
      mapped_bytes_(mapped_bytes),
      capacity_(capacity) {}

Header* Segment::header() const { return static_cast<Header*>(base_); }

// No slot at or above the watermark was ever taken, so scans stop there
// (most segments only ever use a few low slots). take_slot raises it before
// its CAS, both seq_cst: a scan that loads it and then the slots misses only
// slots taken after the scan began, as a scan of every slot would.
int Segment::scan_end() const {
  return static_cast<int>(
      std::min<uint32_t>(header()->slots_used.load(), kSlots));
}

std::shared_ptr<Segment> Segment::create(const std::string& name,
                                         int64_t capacity, uint64_t creator,
                                         int threads) {
  TORCH_CHECK(capacity >= 0, "expected a non-negative capacity, got ",
              capacity);
  const size_t total = kHeaderBytes + static_cast<size_t>(capacity);
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw_errno(errno, "shm_open(", name, ") failed");
  FdCloser closer{fd};
  void* base = MAP_FAILED;
  int err = 0;
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0) {
    err = errno;
  } else {
    base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = base == MAP_FAILED ? errno : populate(fd, base, total, threads);
  }
  if (err != 0) {
    if (base != MAP_FAILED) ::munmap(base, total);
    ::shm_unlink(name.c_str());
    throw_errno(err, "cannot reserve ", total, " bytes for ", name,
                " in /dev/shm");
  }
  // A new file reads as zeros: every slot is empty, generation 0.
  Header* h = static_cast<Header*>(base);
  h->capacity = capacity;
  h->creator = creator;
  h->slots_used.store(1);
  h->slots[0].store(creator);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return std::shared_ptr<Segment>(new Segment(name, base, total, capacity));
}

std::shared_ptr<Segment> Segment::attach(const std::string& name) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0600);
  if (fd < 0)
    throw_errno(errno, "shared-memory segment ", name,
                " is gone: its sender's session ended, or every process "
                "holding it let it go");
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno(errno, "fstat(", name, ") failed");
  // Another user may share /dev/shm: map only what this user made, privately.
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      (st.st_mode & 0777) != 0600)
    throw_errno(EACCES, "refusing to map ", name,
                ": not a regular file of this user with mode 0600 (owner ",
                st.st_uid, ", mode ", std::oct, (st.st_mode & 0777), ")");
  const size_t total = static_cast<size_t>(st.st_size);
  if (total < kHeaderBytes)
    throw_errno(EINVAL, "segment ", name, " is truncated: ", total, " bytes");
  void* base =
      ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw_errno(errno, "mmap of ", name, " failed");
  Header* h = static_cast<Header*>(base);
  if (h->magic != kMagic || h->capacity < 0 ||
      static_cast<uint64_t>(h->capacity) + kHeaderBytes != total) {
    ::munmap(base, total);
    throw_errno(EINVAL, name, " is not a torchshm segment");
  }
  return std::shared_ptr<Segment>(new Segment(name, base, total, h->capacity));
}

Segment::~Segment() { ::munmap(base_, mapped_bytes_); }

int Segment::take_slot(uint64_t holder) {
  Header* h = header();
  for (int i = 0; i < kSlots; ++i) {
    if (h->slots[i].load() != 0) continue;
    uint32_t used = h->slots_used.load();
    const uint32_t wanted = static_cast<uint32_t>(i) + 1;
    while (used < wanted &&
           !h->slots_used.compare_exchange_weak(used, wanted)) {
    }
    uint64_t expected = 0;
    if (h->slots[i].compare_exchange_strong(expected, holder)) return i;
  }
  return -1;
}

void Segment::release_slot(int slot, uint64_t holder) {
  if (slot < 0 || slot >= kSlots) return;
  uint64_t expected = holder;
  if (!header()->slots[slot].compare_exchange_strong(expected, 0)) return;
  if (!has_live_holder()) unlink();
}

uint64_t Segment::issue_ticket(uint64_t channel) {
  const uint64_t ticket = random_id(/*ticket=*/true);
  const int slot = take_slot(ticket);
  if (slot < 0) return 0;
  // A reader may see the previous ticket's channel for an instant; the
  // reaper judges a channel only after it stayed closed for a whole scan.
  header()->channels[slot].store(channel);
  return ticket;
}

int Segment::claim_ticket(uint64_t ticket, uint64_t holder) {
  auto* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    uint64_t expected = ticket;
    if (slots[i].load() == ticket &&
        slots[i].compare_exchange_strong(expected, holder))
      return i;
  }
  return -1;
}

bool Segment::cancel_ticket(uint64_t ticket) {
  auto* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    uint64_t expected = ticket;
    if (slots[i].load() == ticket &&
        slots[i].compare_exchange_strong(expected, 0))
      return true;
  }
  return false;
}

bool Segment::has_live_holder(int except_slot) {
  auto* slots = header()->slots;
  for (int i = 0, end = scan_end(); i < end; ++i) {
    uint64_t word = slots[i].load();
    if (i == except_slot || word == 0) continue;
    // A ticket the reaper found dead (its pipe is closed everywhere). A
    // receiver that claimed it first turned the word into its own id, so
    // this CAS then fails and the receiver keeps its slot.
    const bool dead_ticket =
        (word & kTicketBit) && header()->verdicts[i].load() == word;
    if (!dead_ticket && holder_alive(word)) return true;
    slots[i].compare_exchange_strong(word, 0);  // a dead holder's slot
  }
  return false;
}

bool Segment::reserve_for_reuse(int own_slot) {
  if (views_.load() != 0 || has_live_holder(own_slot)) return false;
  header()->generation.fetch_add(1);
  return !has_live_holder(own_slot);
}

void Segment::unlink() {
  if (header()->unlinked.exchange(1) == 0) ::shm_unlink(name_.c_str());
}

uint8_t* Segment::data() const {
  return static_cast<uint8_t*>(base_) + kHeaderBytes;
}

uint64_t Segment::generation() const { return header()->generation.load(); }

bool Segment::unlinked() const { return header()->unlinked.load() != 0; }

int64_t Segment::holders() const {
  int64_t n = 0;
  for (int i = 0, end = scan_end(); i < end; ++i)
    n += header()->slots[i].load() != 0;
  return n;
}

View::View(std::shared_ptr<Segment> seg, int slot_, uint64_t holder_)
    : segment(std::move(seg)),
      slot(slot_),
      holder(holder_),
      pid(current_pid()) {
  segment->views_.fetch_add(1);
}

View::~View() {
  disown();
  segment->views_.fetch_sub(1);
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

at::Tensor view_tensor(std::shared_ptr<Segment> segment, int slot,
                       uint64_t holder) {
  const int64_t n = segment->capacity();
  void* data = segment->data();
  auto* view = new View(std::move(segment), slot, holder);
  at::DataPtr ptr(data, view, &delete_view, at::Device(at::kCPU));
  at::Storage storage(at::Storage::use_byte_size_t(), n, std::move(ptr),
                      /*allocator=*/nullptr, /*resizable=*/false);
  // What at::empty + set_ make, without two trips through the dispatcher
  // (one is made per message).
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::Make<int8_t>());
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

View* view_of(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return nullptr;
  return tensor.storage().data_ptr().cast_context<View>(&delete_view);
}

}  // namespace torchshm
