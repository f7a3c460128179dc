"""A webhook receiver for the HTTP target's tests: records every request
(method, path, headers, body; a HEAD too, as the relay's health check) as a JSON line, checks each signature with
the Standard Webhooks reference implementation (the `standardwebhooks`
package, not the project's code) against every secret it is given, and
answers as the plan file says at that moment, re-read for each request:

    {"status": 200, "retry_after": null, "delay_s": 0,
     "rules": [{"header": "Switchyard-Event-Type", "equals": "X", "status": 400, "body": "..."}]}

    webhook_receiver.py PORT LOG PLAN [--tls CERT KEY [CLIENT_CA]] [--secret whsec_...]...
"""

import base64
import json
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

port, log_path, plan_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
args = sys.argv[4:]
tls, secrets = None, []
while args:
    if args[0] == "--tls":
        tls = args[1:4] if len(args) > 3 and not args[3].startswith("--") else args[1:3]
        args = args[1 + len(tls):]
    elif args[0] == "--secret":
        secrets.append(args[1])
        args = args[2:]
    else:
        sys.exit(f"unknown argument {args[0]}")

lock = threading.Lock()


def plan():
    try:
        with open(plan_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_):
        pass

    def answer(self, status, body=b"", extra=()):
        self.send_response(status)
        for name, value in extra:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_body(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if self.command != "HEAD" else b""
        now = plan()
        headers = {k.lower(): v for k, v in self.headers.items()}
        verified = []
        for secret in secrets:
            try:
                Webhook(secret).verify(body, headers)
                verified.append(True)
            except WebhookVerificationError:
                verified.append(False)
        status, reply, extra = now.get("status", 200), b"ok", []
        for rule in now.get("rules", []):
            if headers.get(rule["header"].lower()) == rule["equals"]:
                status, reply = rule["status"], rule.get("body", "refused").encode()
        if status != 200 and not now.get("rules"):
            reply = now.get("body", "unavailable").encode()
        if now.get("retry_after") is not None and status in (408, 429, 503):
            extra.append(("Retry-After", str(now["retry_after"])))
        if now.get("delay_s"):
            time.sleep(now["delay_s"])
        record = {
            "time": time.time(),
            "method": self.command,
            "path": self.path,
            "headers": headers,
            "body": base64.b64encode(body).decode(),
            "verified": verified,
            "status": status,
        }
        with lock, open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.command == "HEAD":
            reply = b""
        self.answer(status, reply, extra)

    do_POST = handle_body
    do_PUT = handle_body
    do_HEAD = handle_body


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
if tls:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls[0], tls[1])
    if len(tls) > 2:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tls[2])
    server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
