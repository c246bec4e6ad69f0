// The master's status page (GET /): one self-contained HTML document, no build step, whose
// script asks /status.json every 2 s and draws nodes, tiers and recent events. It holds no
// data itself; with a token, the script asks for it once and sends it as a bearer token.
#pragma once

namespace kvbridge::obs {

extern const char kStatusPageHtml[];

}  // namespace kvbridge::obs
