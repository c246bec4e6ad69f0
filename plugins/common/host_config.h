// Reading the host-services table from inside a plugin: which fields a host of an older ABI
// minor has, logging, and "<plugin>.<key>" settings. Shared by the in-tree plugins (static,
// hidden: every plugin gets its own copy and exports nothing from it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvbridge/plugin/abi.h"

namespace kvbridge::plugin {

// True when a host-services table of its struct_size has the field that ends at `end`, e.g.
// HostHas(host, offsetof(kvb_host_services_t, log) + sizeof(host->log)).
bool HostHas(const kvb_host_services_t* host, size_t end);

// Logs through the host when it offers log(); otherwise drops the line.
void HostLog(const kvb_host_services_t* host, int32_t level, const char* plugin,
             const std::string& msg);

// Reads one key ("tcp.lanes_per_peer"); *set says whether the host has a value. False with a
// message naming the plugin and key when the value does not fit the buffer.
bool ReadConfigKey(const kvb_host_services_t* host, const char* plugin, const char* key,
                   std::string* value, bool* set, std::string* err);

// A whole string of decimal digits, nothing else.
bool ParseUnsigned(const std::string& s, uint64_t* out);

}  // namespace kvbridge::plugin
