#include "obs/status_page.h"

namespace kvbridge::obs {

const char kStatusPageHtml[] = R"html(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kvbridge master</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 20px; color: #222; background: #fafafa; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
h2 { font-size: 16px; margin: 20px 0 6px 0; }
.sub { color: #666; margin-bottom: 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card .v { font-size: 22px; font-weight: 600; }
.card .k { color: #666; font-size: 12px; }
table { border-collapse: collapse; background: #fff; width: 100%; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
.bar { background: #eee; width: 120px; height: 10px; display: inline-block; vertical-align: middle; }
.bar span { background: #3b82f6; height: 10px; display: block; }
.ACTIVE { color: #15803d; } .DRAINING { color: #b45309; } .DEAD { color: #b91c1c; }
.bad { color: #b91c1c; font-weight: 600; }
#error { color: #b91c1c; margin: 8px 0; }
</style>
</head>
<body>
<h1>kvbridge master <span id="addr"></span></h1>
<div class="sub" id="sub">loading /status.json ...</div>
<div id="error"></div>
<div class="cards" id="cards"></div>
<h2>Nodes</h2>
<table><thead><tr><th>Node</th><th>Incarnation</th><th>State</th><th>DRAM used / capacity</th>
<th>SSD used / capacity</th><th>Replicas</th><th>Last heartbeat</th></tr></thead>
<tbody id="nodes"></tbody></table>
<h2>Recent events</h2>
<table><thead><tr><th>Time</th><th>Event</th><th>What happened</th></tr></thead>
<tbody id="events"></tbody></table>
<script>
"use strict";
var token = sessionStorage.getItem("kvbridge_token") || "";
function esc(s) {
  return String(s).replace(/[&<>"]/g, function (c) {
    return {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;"}[c];
  });
}
function bytes(b) {
  var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return (i ? b.toFixed(1) : b) + " " + u[i];
}
function usage(used, cap) {
  if (!cap) return "-";
  var pct = Math.min(100, 100 * used / cap);
  return '<span class="bar"><span style="width:' + pct.toFixed(0) + '%"></span></span> ' +
      bytes(used) + " / " + bytes(cap) + " (" + pct.toFixed(1) + "%)";
}
function card(k, v, bad) {
  return '<div class="card"><div class="v' + (bad ? " bad" : "") + '">' + esc(v) +
      '</div><div class="k">' + esc(k) + "</div></div>";
}
function render(s) {
  document.getElementById("addr").textContent = s.master;
  document.getElementById("sub").textContent = (s.is_leader ? "leader" : "NOT the leader") +
      ", up " + s.uptime_s + " s, refreshed " + new Date().toLocaleTimeString();
  var active = s.nodes.filter(function (n) { return n.state !== "DEAD"; }).length;
  document.getElementById("cards").innerHTML =
      card("nodes serving", active) + card("objects", s.objects) +
      card("stored", bytes(s.stored_bytes)) + card("puts in progress", s.pending_puts) +
      card("under-replicated", s.under_replicated, s.under_replicated > 0) +
      card("re-replications running", s.tasks_in_flight) +
      card("replicas on SSD", s.ssd_replicas) + card("evicted", s.evictions_total) +
      card("bad replicas dropped", s.bad_replicas_total, s.bad_replicas_total > 0) +
      card("nodes expired", s.nodes_expired_total, s.nodes_expired_total > 0);
  document.getElementById("nodes").innerHTML = s.nodes.map(function (n) {
    return "<tr><td>" + esc(n.node_id) + "</td><td><code>" + esc(n.incarnation) +
        '</code></td><td class="' + esc(n.state) + '">' + esc(n.state) + "</td><td>" +
        usage(n.dram_used, n.dram_capacity) + "</td><td>" + usage(n.ssd_used, n.ssd_capacity) +
        "</td><td>" + n.replicas + "</td><td>" +
        (n.state === "DEAD" ? "-" : (n.heartbeat_age_ms / 1000).toFixed(1) + " s ago") +
        "</td></tr>";
  }).join("") || '<tr><td colspan="7">no nodes registered</td></tr>';
  document.getElementById("events").innerHTML = s.events.map(function (e) {
    return "<tr><td>" + esc(new Date(e.unix_ms).toLocaleString()) + "</td><td>" + esc(e.kind) +
        "</td><td>" + esc(e.text) + "</td></tr>";
  }).join("") || '<tr><td colspan="3">none since the master started</td></tr>';
}
function poll() {
  var headers = token ? {"Authorization": "Bearer " + token} : {};
  fetch("status.json", {headers: headers, cache: "no-store"}).then(function (r) {
    if (r.status === 401) {
      var t = window.prompt("This cluster has a token. Token for the status page:");
      if (t) { token = t; sessionStorage.setItem("kvbridge_token", t); }
      throw new Error("the master wants the cluster's token (HTTP 401)");
    }
    if (!r.ok) throw new Error("status.json: HTTP " + r.status);
    return r.json();
  }).then(function (s) {
    document.getElementById("error").textContent = "";
    render(s);
  }).catch(function (e) {
    document.getElementById("error").textContent = "cannot refresh: " + e.message;
  });
}
poll();
setInterval(poll, 2000);
</script>
</body>
</html>
)html";

}  // namespace kvbridge::obs
