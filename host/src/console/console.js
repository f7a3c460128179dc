// Switchyard console: refreshes a live page's <main> every second while
// the tab is visible, by fetching the same page and swapping its content.
(function () {
  "use strict";
  var live = document.querySelector("main[data-live]");
  if (!live) { return; }
  function tick() {
    if (document.visibilityState !== "visible") { setTimeout(tick, 1000); return; }
    fetch(location.href, { credentials: "same-origin", headers: { "X-Console-Refresh": "1" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (text) {
        if (text === null) { return; }
        var next = new DOMParser().parseFromString(text, "text/html").querySelector("main[data-live]");
        if (next) { live.replaceChildren.apply(live, Array.prototype.slice.call(next.childNodes)); }
      })
      .catch(function () { /* the relay restarts or the network blinks: try again */ })
      .then(function () { setTimeout(tick, 1000); });
  }
  setTimeout(tick, 1000);
})();
