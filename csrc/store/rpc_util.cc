#include "store/rpc_util.h"

#include <charconv>
#include <cstdlib>
#include <string>

#include "util/logging.h"

namespace kvbridge::store {

Status FromGrpc(const grpc::Status& s, std::string_view call) {
  const std::string what = std::string(call) + ": ";
  if (s.ok()) return Status::Protocol(what + "malformed reply from the master");
  switch (s.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return Status::DeadlineExceeded(what + "the master did not answer in time");
    case grpc::StatusCode::UNAVAILABLE:
      return Status::PeerUnreachable(what + "master unreachable: " + s.error_message());
    case grpc::StatusCode::INVALID_ARGUMENT:
      return Status::InvalidArgument(what + s.error_message());
    case grpc::StatusCode::UNIMPLEMENTED:
      return Status::Unsupported(what + s.error_message());
    default:
      return Status::Internal(what + "rpc failed (" + std::to_string(s.error_code()) +
                              "): " + s.error_message());
  }
}

Result<std::unique_ptr<grpc::Server>> StartServer(const std::string& listen, grpc::Service* service,
                                                  std::string_view what, std::string* address) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return Status::Unavailable(std::string(what) + " cannot listen on " + listen +
                               " (address in use or malformed?)");
  }
  *address = listen.substr(0, listen.rfind(':')) + ":" + std::to_string(port);
  return server;
}

template <typename T>
static void EnvNumber(const char* var, T* out) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  std::string_view s(v);
  T value{};
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size()) {
    KVB_LOG(WARN) << "ignoring " << var << "='" << s << "': not an unsigned number";
    return;
  }
  *out = value;
}

void EnvUint(const char* var, uint32_t* out) { EnvNumber(var, out); }
void EnvUint64(const char* var, uint64_t* out) { EnvNumber(var, out); }

}  // namespace kvbridge::store
