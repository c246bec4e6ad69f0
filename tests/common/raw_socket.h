// Raw TCP clients for tests that misbehave on a server's port (send garbage, stay silent, hold a
// handshake slot) and check that the server closes them. No kvbridge dependency.
#pragma once

#include <cstdint>

namespace kvbridge::testing {

// A blocking TCP socket connected to 127.0.0.1:port, or -1 when the connect fails.
int ConnectLoopback(uint16_t port);

// True when the peer closes fd within `ms` milliseconds (anything it sends first is read and
// dropped); false when it is still open then.
bool ClosedWithin(int fd, int ms);

}  // namespace kvbridge::testing
