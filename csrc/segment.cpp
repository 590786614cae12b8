#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <mutex>
#include <vector>

#include "errors.h"
#include "identity.h"
#include "parallel.h"

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
int populate(int fd, void* base, size_t total, int threads) {
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
                                         int threads) {
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
  // What /proc/<pid>/maps shows (torchshm._doctor.SEGMENT_MAPPING).
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
    err = base == MAP_FAILED ? errno : populate(fd, base, total, threads);
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
  return std::shared_ptr<Segment>(
      new Segment(session, uid, base, total, h->capacity, -1, 0));
}

Segment::~Segment() {
  ::munmap(base_, mapped_bytes_);
  close_fd();
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

View::View(std::shared_ptr<Segment> seg, int slot_, uint64_t holder_)
    : segment(std::move(seg)),
      slot(slot_),
      holder(holder_),
      pid(current_pid()) {
  segment->views_.fetch_add(1);
}

View::~View() {
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
