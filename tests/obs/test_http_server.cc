// The HTTP endpoint on its own: routes, 404/405, the bearer token, binding errors.
#include <gtest/gtest.h>

#include "obs/http_server.h"
#include "tests/common/http_get.h"

namespace kvbridge::obs {
namespace {

using testing::HttpGet;
using testing::PortOf;

std::map<std::string, HttpRoute> Routes() {
  std::map<std::string, HttpRoute> routes;
  routes["/metrics"] = {[] { return HttpResponse{200, "text/plain; version=0.0.4", "m 1\n"}; }};
  routes["/health"] = {[] {
                         return HttpResponse{503, "text/plain", "not serving: why\n"};
                       },
                       /*is_public=*/true};
  return routes;
}

TEST(HttpServer, ServesRoutesByPath) {
  auto server = HttpServer::Start("127.0.0.1:0", Routes(), "");
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const uint16_t port = PortOf(server.value()->address());
  ASSERT_NE(port, 0);
  auto m = HttpGet(port, "/metrics");
  EXPECT_EQ(m.status, 200) << m.error;
  EXPECT_EQ(m.body, "m 1\n");
  EXPECT_EQ(m.content_type, "text/plain; version=0.0.4");
  auto h = HttpGet(port, "/health");
  EXPECT_EQ(h.status, 503);
  EXPECT_EQ(h.body, "not serving: why\n");
  EXPECT_EQ(HttpGet(port, "/nope").status, 404);
}

TEST(HttpServer, TokenGuardsAllButPublicRoutes) {
  auto server = HttpServer::Start("127.0.0.1:0", Routes(), "s3cret");
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const uint16_t port = PortOf(server.value()->address());
  auto none = HttpGet(port, "/metrics");
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.body.find("m 1"), std::string::npos);
  EXPECT_EQ(HttpGet(port, "/metrics", "Bearer wrong!").status, 401);
  auto ok = HttpGet(port, "/metrics", "Bearer s3cret");
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(ok.body, "m 1\n");
  EXPECT_EQ(HttpGet(port, "/health").status, 503);  // public: answers without the token
}

TEST(HttpServer, BusyOrMalformedAddressIsAnErrorNamingIt) {
  auto first = HttpServer::Start("127.0.0.1:0", Routes(), "");
  ASSERT_TRUE(first.ok());
  const std::string taken = first.value()->address();
  auto second = HttpServer::Start(taken, Routes(), "");
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(second.status().Is(StatusCode::kUnavailable)) << second.status().ToString();
  EXPECT_NE(second.status().ToString().find(taken), std::string::npos)
      << second.status().ToString();
  auto bad = HttpServer::Start("no-port-here", Routes(), "");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().Is(StatusCode::kInvalidArgument)) << bad.status().ToString();
}

}  // namespace
}  // namespace kvbridge::obs
