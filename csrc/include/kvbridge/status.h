// Status and Result<T>: the one error type of kvbridge.
//
// A Status is a code plus a message. It is free on success (no allocation) and cheap to move.
// Codes name what happened (STALE_PEER, DEADLINE_EXCEEDED, ...) so a caller can act on them;
// their numeric values equal the plugin ABI's kvb_status_t codes (plugin/abi.h).
// Result<T> holds either a T or a non-OK Status.
//
// Thread-safety: distinct objects may be used from different threads; a single object must
// not be mutated concurrently (like std::string).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "kvbridge/export.h"
#include "kvbridge/plugin/abi.h"

namespace kvbridge {

enum class StatusCode : int32_t {
  kOk = KVB_OK,
  kInProgress = KVB_IN_PROGRESS,
  kInvalidArgument = KVB_ERR_INVALID_ARGUMENT,
  kNotFound = KVB_ERR_NOT_FOUND,
  kAlreadyExists = KVB_ERR_ALREADY_EXISTS,
  kNotRegistered = KVB_ERR_NOT_REGISTERED,
  kOutOfBounds = KVB_ERR_OUT_OF_BOUNDS,
  kStalePeer = KVB_ERR_STALE_PEER,
  kPeerUnreachable = KVB_ERR_PEER_UNREACHABLE,
  kDeadlineExceeded = KVB_ERR_DEADLINE_EXCEEDED,
  kProgressTimeout = KVB_ERR_PROGRESS_TIMEOUT,
  kBackpressure = KVB_ERR_BACKPRESSURE,
  kCancelled = KVB_ERR_CANCELLED,
  kProtocol = KVB_ERR_PROTOCOL,
  kUnauthenticated = KVB_ERR_UNAUTHENTICATED,
  kUnsupported = KVB_ERR_UNSUPPORTED,
  kUnavailable = KVB_ERR_UNAVAILABLE,
  kNoSpace = KVB_ERR_NO_SPACE,
  kIoError = KVB_ERR_IO,
  kInternal = KVB_ERR_INTERNAL,
  kPermissionDenied = KVB_ERR_PERMISSION_DENIED,
  kUnknownMemory = KVB_ERR_UNKNOWN_MEMORY,
};

// "STALE_PEER", "DEADLINE_EXCEEDED", ...; "UNKNOWN(<n>)" for codes this build does not know.
KVBRIDGE_API std::string StatusCodeName(StatusCode code);

// Which remote party a failure came from, where a caller must tell them apart without reading
// the message: a store call can fail at the master (metadata) or at a storage node (the
// bytes), with the same code. kUnspecified: this process, a transfer's peer engine, or not
// said. Kept by copies and WithContext.
enum class StatusOrigin : uint8_t {
  kUnspecified = 0,
  kMaster = 1,
  kStorageNode = 2,
};

// "", "master", "storage_node".
KVBRIDGE_API const char* StatusOriginName(StatusOrigin origin);

class [[nodiscard]] KVBRIDGE_API Status {
 public:
  Status() noexcept = default;  // OK
  Status(StatusCode code, std::string_view msg);
  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status OK() { return Status(); }
  static Status InProgress(std::string_view m = {}) { return {StatusCode::kInProgress, m}; }
  static Status InvalidArgument(std::string_view m) { return {StatusCode::kInvalidArgument, m}; }
  static Status NotFound(std::string_view m) { return {StatusCode::kNotFound, m}; }
  static Status AlreadyExists(std::string_view m) { return {StatusCode::kAlreadyExists, m}; }
  static Status NotRegistered(std::string_view m) { return {StatusCode::kNotRegistered, m}; }
  static Status OutOfBounds(std::string_view m) { return {StatusCode::kOutOfBounds, m}; }
  static Status StalePeer(std::string_view m) { return {StatusCode::kStalePeer, m}; }
  static Status PeerUnreachable(std::string_view m) { return {StatusCode::kPeerUnreachable, m}; }
  static Status DeadlineExceeded(std::string_view m) { return {StatusCode::kDeadlineExceeded, m}; }
  static Status ProgressTimeout(std::string_view m) { return {StatusCode::kProgressTimeout, m}; }
  static Status Backpressure(std::string_view m) { return {StatusCode::kBackpressure, m}; }
  static Status Cancelled(std::string_view m) { return {StatusCode::kCancelled, m}; }
  static Status Protocol(std::string_view m) { return {StatusCode::kProtocol, m}; }
  static Status Unauthenticated(std::string_view m) { return {StatusCode::kUnauthenticated, m}; }
  static Status Unsupported(std::string_view m) { return {StatusCode::kUnsupported, m}; }
  static Status Unavailable(std::string_view m) { return {StatusCode::kUnavailable, m}; }
  static Status NoSpace(std::string_view m) { return {StatusCode::kNoSpace, m}; }
  static Status IoError(std::string_view m) { return {StatusCode::kIoError, m}; }
  static Status Internal(std::string_view m) { return {StatusCode::kInternal, m}; }
  static Status PermissionDenied(std::string_view m) { return {StatusCode::kPermissionDenied, m}; }
  static Status UnknownMemory(std::string_view m) { return {StatusCode::kUnknownMemory, m}; }
  // From a plugin's int32 code; unknown codes become kInternal with the number in the message.
  static Status FromAbi(kvb_status_t code, std::string_view msg);

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  const std::string& message() const;
  bool Is(StatusCode c) const { return code() == c; }
  bool IsStalePeer() const { return Is(StatusCode::kStalePeer); }
  bool IsPeerUnreachable() const { return Is(StatusCode::kPeerUnreachable); }
  bool IsDeadlineExceeded() const { return Is(StatusCode::kDeadlineExceeded); }
  bool IsNotFound() const { return Is(StatusCode::kNotFound); }
  StatusOrigin origin() const { return state_ ? state_->origin : StatusOrigin::kUnspecified; }
  // Same code and message, marked as coming from `origin` (an OK status stays OK).
  Status WithOrigin(StatusOrigin origin) const;

  // "OK" or "STALE_PEER: <message>".
  std::string ToString() const;
  // Same code and origin, message prefixed with context: "<context>: <message>".
  Status WithContext(std::string_view context) const;

 private:
  struct State {
    StatusCode code;
    std::string msg;
    StatusOrigin origin = StatusOrigin::kUnspecified;
  };
  std::unique_ptr<State> state_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status::Internal("Result built from an OK status without value");
  }
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace kvbridge

#define KVB_RETURN_IF_ERROR(expr)        \
  do {                                   \
    ::kvbridge::Status _kvb_st = (expr); \
    if (!_kvb_st.ok()) return _kvb_st;   \
  } while (0)
