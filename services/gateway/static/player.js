// TurboServe playground: what needs no page. Pure functions of the messages, loaded before
// playground.js in the page, and by tests under Node (module.exports at the end).
"use strict";

// The line the event log shows for a control's ack. A close has no next seq: nothing follows
// it. Any other control says from which seq it holds once the worker confirms it, and only
// "accepted" before.
function ackText(msg) {
  if (msg.control === "close") {
    return msg.last_seq >= 0 ? `closed after seq ${msg.last_seq}` : "closed";
  }
  if (!msg.confirmed) return "accepted; the worker has not confirmed it yet";
  return msg.next_seq === null || msg.next_seq === undefined
    ? "done" : `done, from seq ${msg.next_seq}`;
}

if (typeof module !== "undefined") module.exports = { ackText };
