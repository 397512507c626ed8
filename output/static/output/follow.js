/* Follows an Attempt's output on the Run and Attempt pages (output/templates/output/panel.html).
 *
 * Vendored with the app, no CDN, no framework: it polls the operator API
 * (GET /api/v1/runs/{id}/output?attempt=N&after=SEQ, with the admin session)
 * every 2 s while the Attempt runs, appends the new chunks as text (never as
 * HTML), keeps the view scrolled to the end unless the operator scrolled up,
 * and on the Run page moves on to a retry's Attempt when one follows.
 */
(function () {
  "use strict";

  var POLL_MS = 2000;
  var MAX_BACKOFF_MS = 30000;
  var MAX_CHARS = 1024 * 1024; // what the page keeps; older text is cut from the top

  function follow(panel) {
    var url = panel.getAttribute("data-url");
    var pinned = panel.getAttribute("data-pinned") === "1";
    var attempt = panel.getAttribute("data-attempt");
    var after = Number(panel.getAttribute("data-after") || "0");
    var pre = panel.querySelector(".ql-output-text");
    var status = panel.querySelector(".ql-output-status");
    var numberLabel = panel.querySelector(".ql-output-attempt");
    var stateLabel = panel.querySelector(".ql-output-state");
    var failures = 0;

    function atEnd() {
      return pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
    }

    function append(text) {
      var stick = atEnd();
      pre.appendChild(document.createTextNode(text));
      if (pre.textContent.length > MAX_CHARS) {
        pre.textContent = pre.textContent.slice(-MAX_CHARS);
      }
      if (stick) {
        pre.scrollTop = pre.scrollHeight;
      }
    }

    function setStatus(text) {
      status.textContent = text;
    }

    function later(ms) {
      window.setTimeout(poll, ms);
    }

    function show(page) {
      if (page.attempt) {
        if (numberLabel) numberLabel.textContent = String(page.attempt.number);
        if (stateLabel) stateLabel.textContent = page.attempt.state;
      }
      if (page.truncated && page.truncated.dropped_through_seq > after && after > 0) {
        append("\n[… earlier output dropped: only the newest is kept …]\n");
      }
      page.chunks.forEach(function (chunk) {
        if (chunk.skipped_bytes > 0) {
          append("\n[… " + chunk.skipped_bytes + " bytes skipped by the Worker …]\n");
        }
        append(chunk.text);
      });
      after = page.next_after;
      panel.setAttribute("data-after", String(after));
      panel.setAttribute("data-live", page.live ? "1" : "0");
    }

    function poll() {
      var query = "?after=" + after + (attempt ? "&attempt=" + attempt : "");
      fetch(url + query, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          if (!response.ok) {
            throw new Error("HTTP " + response.status);
          }
          return response.json();
        })
        .then(function (page) {
          failures = 0;
          if (!attempt && page.attempt) {
            attempt = String(page.attempt.number);
          }
          show(page);
          if (page.more) {
            later(0);
          } else if (page.live) {
            setStatus("Following… (every " + POLL_MS / 1000 + " s)");
            later(POLL_MS);
          } else if (!pinned && page.latest_attempt && String(page.latest_attempt) !== attempt) {
            // The Attempt ended and a retry exists: follow the new one.
            attempt = String(page.latest_attempt);
            after = 0;
            append("\n[… attempt #" + attempt + " …]\n");
            later(0);
          } else {
            setStatus("The attempt has ended.");
          }
        })
        .catch(function (error) {
          failures += 1;
          var wait = Math.min(MAX_BACKOFF_MS, POLL_MS * Math.pow(2, failures));
          setStatus("Output unavailable (" + error.message + "); trying again in " +
            Math.round(wait / 1000) + " s.");
          later(wait);
        });
    }

    if (panel.getAttribute("data-live") === "1" || !attempt) {
      pre.scrollTop = pre.scrollHeight;
      later(0);
    }
  }

  document.querySelectorAll(".ql-output[data-url]").forEach(follow);
})();
