#include "kvbridge/status.h"

#include <string>

namespace kvbridge {

std::string StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInProgress:
      return "IN_PROGRESS";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kNotRegistered:
      return "NOT_REGISTERED";
    case StatusCode::kOutOfBounds:
      return "OUT_OF_BOUNDS";
    case StatusCode::kStalePeer:
      return "STALE_PEER";
    case StatusCode::kPeerUnreachable:
      return "PEER_UNREACHABLE";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kProgressTimeout:
      return "PROGRESS_TIMEOUT";
    case StatusCode::kBackpressure:
      return "BACKPRESSURE";
    case StatusCode::kCancelled:
      return "CANCELLED";
    case StatusCode::kProtocol:
      return "PROTOCOL";
    case StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
    case StatusCode::kUnsupported:
      return "UNSUPPORTED";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kNoSpace:
      return "NO_SPACE";
    case StatusCode::kIoError:
      return "IO_ERROR";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case StatusCode::kUnknownMemory:
      return "UNKNOWN_MEMORY";
  }
  return "UNKNOWN(" + std::to_string(static_cast<int32_t>(code)) + ")";
}

const char* StatusOriginName(StatusOrigin origin) {
  switch (origin) {
    case StatusOrigin::kUnspecified:
      return "";
    case StatusOrigin::kMaster:
      return "master";
    case StatusOrigin::kStorageNode:
      return "storage_node";
  }
  return "";
}

Status::Status(StatusCode code, std::string_view msg) {
  if (code != StatusCode::kOk) state_ = std::make_unique<State>(State{code, std::string(msg)});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

Status Status::FromAbi(kvb_status_t code, std::string_view msg) {
  if (code == KVB_OK) return Status();
  if (code < 0 || code >= KVB_STATUS_CODE_COUNT) {
    return Internal("plugin returned unknown status " + std::to_string(code) + ": " +
                    std::string(msg));
  }
  return Status(static_cast<StatusCode>(code), msg);
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->msg : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s = StatusCodeName(state_->code);
  if (!state_->msg.empty()) {
    s += ": ";
    s += state_->msg;
  }
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return Status();
  std::string m(context);
  if (!state_->msg.empty()) {
    m += ": ";
    m += state_->msg;
  }
  Status s(state_->code, m);
  s.state_->origin = state_->origin;
  return s;
}

Status Status::WithOrigin(StatusOrigin origin) const {
  Status s(*this);
  if (s.state_) s.state_->origin = origin;
  return s;
}

}  // namespace kvbridge
