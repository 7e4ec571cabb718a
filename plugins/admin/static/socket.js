// The admin websocket (protocol: plugins/admin/ws.py): first-message auth, replies
// matched to requests by `id`, pushed kv_event / request_event messages to a callback.

const REPLY_TIMEOUT_MS = 10000;
const POLICY_VIOLATION = 1008; // the server's close code for a missing or wrong key

// Block hashes are unsigned 64-bit integers: parse the unsafe ones as BigInt
// (JSON.parse source access); on a browser without it they stay (rounded) numbers.
export function parseMessage(text) {
  return JSON.parse(text, (key, value, context) => {
    if (typeof value === "number" && Number.isInteger(value) && !Number.isSafeInteger(value)
        && context && /^\d+$/.test(context.source)) {
      return BigInt(context.source);
    }
    return value;
  });
}

export function socketUrl(location) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/admin/ws`;
}

export class AdminSocket {
  // onEvent(msg) for pushed events; onClose(event) once an authenticated socket closes.
  constructor(url, { onEvent, onClose }) {
    this.url = url;
    this.onEvent = onEvent;
    this.onClose = onClose;
    this.ws = null;
    this.seq = 0;
    this.pending = new Map();
  }

  // Opens the socket and authenticates with `key` ("" when none is stored: a server
  // without a key answers ok anyway). Resolves to "ok", "needs_key" or "closed".
  connect(key) {
    return new Promise((resolve) => {
      const ws = new WebSocket(this.url);
      let authed = false;
      this.ws = ws;
      ws.onopen = () => ws.send(JSON.stringify({ type: "auth", key: key || "" }));
      ws.onmessage = (event) => {
        const msg = parseMessage(event.data);
        if (authed) {
          this.dispatch(msg);
        } else if (msg.type === "auth" && msg.ok) {
          authed = true;
          resolve("ok");
        } // else: the refusal, followed by close 1008
      };
      ws.onclose = (event) => {
        this.failPending(new Error("the admin socket closed"));
        if (!authed) {
          resolve(event.code === POLICY_VIOLATION ? "needs_key" : "closed");
        } else if (this.ws === ws) {
          this.onClose(event);
        }
      };
    });
  }

  dispatch(msg) {
    if (msg.type === "kv_event" || msg.type === "request_event") {
      this.onEvent(msg);
      return;
    }
    const waiter = this.pending.get(msg.id);
    if (waiter === undefined) return;
    this.pending.delete(msg.id);
    clearTimeout(waiter.timer);
    if (msg.type === "error") waiter.reject(new Error(msg.message));
    else waiter.resolve(msg);
  }

  // Sends `msg` with a fresh id; resolves with its reply, rejects on an error reply.
  request(msg) {
    const ws = this.ws;
    if (ws === null || ws.readyState !== WebSocket.OPEN) {
      return Promise.reject(new Error("not connected"));
    }
    const id = ++this.seq;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new Error(`${msg.type}: no reply within ${REPLY_TIMEOUT_MS / 1000} s`));
      }, REPLY_TIMEOUT_MS);
      this.pending.set(id, { resolve, reject, timer });
      ws.send(JSON.stringify({ ...msg, id }));
    });
  }

  failPending(error) {
    for (const waiter of this.pending.values()) {
      clearTimeout(waiter.timer);
      waiter.reject(error);
    }
    this.pending.clear();
  }
}
