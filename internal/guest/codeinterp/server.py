#!/usr/bin/python3
"""space's code interpreter server.

It runs inside sandboxes of the builtin template code-interpreter-v1 (started by the
template's start command, as the template's user) and speaks the HTTP API that E2B's
code interpreter SDKs (npm @e2b/code-interpreter, PyPI e2b-code-interpreter) use on
port 49999:

  GET    /health                 200 "OK" once the default Python context is ready
  POST   /execute                {code, context_id?, language?, env_vars?} -> NDJSON stream
  POST   /contexts               {language?, cwd?} -> {id, language, cwd}
  GET    /contexts               -> [{id, language, cwd}]
  POST   /contexts/{id}/restart  -> 200 (state cleared)
  DELETE /contexts/{id}          -> 200

An execution streams one JSON object per line: {"type": "stdout"|"stderr", "text"},
{"type": "result", "is_main_result", "text"?, "html"?, "png"?, "svg"?, "json"?, ...},
{"type": "error", "name", "value", "traceback"}, {"type": "number_of_executions",
"execution_count"}, and last {"type": "end_of_execution"}. A client that goes away
(the SDK's execution timeout closes the connection) interrupts the execution.

Python contexts are Jupyter kernels (ipykernel, driven with jupyter_client); bash
contexts are a persistent bash process. Only the Python standard library, Debian's
python3-jupyter-client and the kernel's own packages are used: the server must run
from the template's Debian packages with no network.
"""

import codecs
import datetime
import json
import os
import queue
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(os.environ.get("SPACE_CODEINTERP_PORT", "49999"))
HOME = os.path.expanduser("~")
LANGUAGES = ("python", "bash")
# How long an interrupted execution may take to wind down before its context is
# restarted.
INTERRUPT_GRACE = 10.0
# Jupyter's MIME types -> the fields of E2B's result lines.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def log(*args):
    print(datetime.datetime.now().isoformat(timespec="milliseconds"), *args, file=sys.stderr, flush=True)


class ContextNotFound(Exception):
    pass


class BadRequest(Exception):
    pass


class Execution:
    """One request's view of an execution: emit() writes a line, gone() tells whether
    the client left."""

    def __init__(self, emit, gone):
        self.emit = emit
        self.gone = gone


def error_line(name, value, traceback=""):
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def result_line(data, is_main):
    out = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    # A main result that is a string shows as its repr ('abc'); E2B gives the string.
    if is_main and isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] == "'":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


# Runs silently in every new Python kernel: DataFrames also render as "e2b/data"
# (E2B's data field), figures as PNG.
PYTHON_SETUP = r"""
def __space_setup():
    import json
    from IPython import get_ipython
    from IPython.core.formatters import JSONFormatter
    from traitlets import Unicode, ObjectName

    class DataFormatter(JSONFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")

    ip = get_ipython()
    fmt = DataFormatter(parent=ip.display_formatter)
    ip.display_formatter.formatters["e2b/data"] = fmt
    fmt.for_type_by_name("pandas.core.frame", "DataFrame",
                         lambda df: json.loads(df.to_json(orient="split", date_format="iso", default_handler=str)))
__space_setup()
del __space_setup
"""


def identity():
    """The sandbox's identity as far as this process can see it: the agent sets the
    host name to the sandbox id. Sandboxes restored from one snapshot start with the
    same memory, so a context whose identity changed reseeds its random generators
    before it runs anything."""
    return socket.gethostname()


# Starts ipykernel with its IOPub pipe (how output of forked child processes reaches
# the kernel) on a unix socket instead of TCP on 127.0.0.1: see PythonContext.start.
# The two methods replaced are ipykernel 6's (Debian bookworm's); another version
# starts unpatched.
KERNEL_LAUNCHER = r"""
import os, tempfile
import zmq
from ipykernel import iostream

if hasattr(iostream.IOPubThread, "_setup_pipe_in") and hasattr(iostream.IOPubThread, "_setup_pipe_out"):
    _pipe = "ipc://" + os.path.join(tempfile.mkdtemp(prefix="space-iopub-"), "pipe")

    def _setup_pipe_in(self):
        self._pipe_uuid = os.urandom(16)
        pipe_in = self.socket.context.socket(zmq.PULL)
        pipe_in.linger = 0
        pipe_in.bind(_pipe)
        self._pipe_in = iostream.ZMQStream(pipe_in, self.io_loop)
        self._pipe_in.on_recv(self._handle_pipe_msg)

    def _setup_pipe_out(self):
        ctx = zmq.Context()
        pipe_out = ctx.socket(zmq.PUSH)
        pipe_out.linger = 3000
        pipe_out.connect(_pipe)
        return ctx, pipe_out

    iostream.IOPubThread._setup_pipe_in = _setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = _setup_pipe_out

from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""


def kernel_manager_class():
    from jupyter_client.manager import KernelManager

    class SpaceKernelManager(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return [sys.executable, "-c", KERNEL_LAUNCHER, "-f", self.connection_file]

    return SpaceKernelManager


class PythonContext:
    """A Jupyter kernel (ipykernel)."""

    language = "python"
    RESEED = ("import os as __o, random as __r, sys as __s\n__r.seed(__o.urandom(32))\n"
              "if 'numpy' in __s.modules: __s.modules['numpy'].random.seed(int.from_bytes(__o.urandom(4), 'little'))\n"
              "del __o, __r, __s\n")

    def __init__(self, cwd):
        self.id = str(uuid.uuid4())
        self.identity = identity()
        self.cwd = cwd
        self.lock = threading.Lock()  # one execution at a time
        self.generation = 0  # bumped by restarts that did not wait for an execution
        self.km = None
        self.kc = None

    def start(self):
        env = dict(os.environ)
        # The kernel's channels (and its IOPub pipe, KERNEL_LAUNCHER) are unix sockets,
        # not TCP: gVisor cannot checkpoint a sandbox in which a TCP socket sits in an
        # epoll set (ZeroMQ's I/O threads keep theirs there), and the sandbox must
        # survive pause and resume.
        self.sockdir = tempfile.mkdtemp(prefix="space-kernel-")
        self.km = kernel_manager_class()(kernel_name="python3", transport="ipc", ip=os.path.join(self.sockdir, "k"))
        self.km.start_kernel(cwd=self.cwd, env=env)
        self._connect()

    def _connect(self):
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._silent(PYTHON_SETUP)

    def _silent(self, code, timeout=60):
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status" \
                    and msg["content"]["execution_state"] == "idle":
                break
        self._drain_shell()

    def _drain_shell(self):
        while True:
            try:
                self.kc.get_shell_msg(timeout=0)
            except queue.Empty:
                return

    def interrupt(self):
        if self.km is not None:
            self.km.interrupt_kernel()

    def restart(self):
        self.kc.stop_channels()
        self.km.restart_kernel(now=True)
        self._connect()

    def shutdown(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)
            shutil.rmtree(self.sockdir, ignore_errors=True)

    def execute(self, code, env_vars, ex):
        gen = self.generation
        if self.identity != identity():
            self._silent(self.RESEED)
            self.identity = identity()
        if env_vars:
            keys = json.dumps(sorted(env_vars))
            self._silent("import os as __space_os\n__space_env = {k: __space_os.environ.get(k) for k in %s}\n"
                         "__space_os.environ.update(%s)\n" % (keys, json.dumps(env_vars)))
        try:
            self._run(code, ex, gen)
        finally:
            if env_vars and gen == self.generation and self.km.is_alive():
                self._silent("for __k, __v in __space_env.items():\n"
                             "    if __v is None: __space_os.environ.pop(__k, None)\n"
                             "    else: __space_os.environ[__k] = __v\n"
                             "del __space_env, __space_os\n")

    def _run(self, code, ex, gen):
        # stop_on_error=False: executions of a context are serialized here, so there is
        # never a queued request an error should abort, and with it ipykernel aborts
        # the next request if it arrives while it is still recovering from an error.
        msg_id = self.kc.execute(code, silent=False, store_history=True, allow_stdin=False, stop_on_error=False)
        interrupted_at = None
        while True:
            if interrupted_at is None and ex.gone():
                log("client gone: interrupting context", self.id)
                self.interrupt()
                interrupted_at = time.time()
            if gen != self.generation:
                ex.emit(error_line("ContextRestarted", "the context was restarted during the execution"))
                return
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                if not self.km.is_alive():
                    ex.emit(error_line("UnexpectedEndOfExecution", "the kernel died; the context was restarted"))
                    self.km.restart_kernel(now=True)
                    self.kc.stop_channels()
                    self._connect()
                    return
                if interrupted_at is not None and time.time() - interrupted_at > INTERRUPT_GRACE:
                    log("interrupted execution did not end: restarting context", self.id)
                    self.restart()
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                ex.emit({"type": "stdout" if content.get("name") == "stdout" else "stderr", "text": content.get("text", ""),
                         "timestamp": str(msg["header"].get("date", ""))})
            elif kind == "execute_input":
                ex.emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
            elif kind == "execute_result":
                ex.emit(result_line(content.get("data", {}), True))
            elif kind == "display_data":
                ex.emit(result_line(content.get("data", {}), False))
            elif kind == "error":
                ex.emit(error_line(content.get("ename", ""), content.get("evalue", ""), "\n".join(content.get("traceback", []))))
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        self._drain_shell()


class BashContext:
    """A persistent bash process: variables, functions and the working directory last
    from one execution to the next."""

    language = "bash"

    def __init__(self, cwd):
        self.id = str(uuid.uuid4())
        self.identity = identity()
        self.cwd = cwd
        self.lock = threading.Lock()
        self.generation = 0
        self.proc = None
        self.out = None
        self.count = 0

    def start(self):
        self.proc = subprocess.Popen(["/bin/bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.cwd,
                                     start_new_session=True, bufsize=0)
        self.out = queue.Queue()
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            threading.Thread(target=self._read, args=(name, stream, self.out), daemon=True).start()
        # An interrupt ends the sourced code (return from the trap returns from the
        # sourced file); the shell stays. (A trap, not an ignored signal: commands
        # would inherit that.)
        self._write("trap 'return 130 2>/dev/null' INT\n")

    @staticmethod
    def _read(name, stream, out):
        while True:
            data = os.read(stream.fileno(), 65536)
            if not data:
                out.put((name, None))
                return
            out.put((name, data))

    def _write(self, text):
        self.proc.stdin.write(text.encode())

    def interrupt(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)

    def shutdown(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self):
        self.shutdown()
        self.count = 0
        self.start()

    def execute(self, code, env_vars, ex):
        gen = self.generation
        for k in (env_vars or {}):
            if not k.isidentifier():
                raise BadRequest("environment variable name %r is not valid in bash" % k)
        self.count += 1
        ex.emit({"type": "number_of_executions", "execution_count": self.count})
        fd, path = tempfile.mkstemp(prefix=".space-code-", suffix=".sh")
        with os.fdopen(fd, "w") as f:
            f.write(code)
            if not code.endswith("\n"):
                f.write("\n")
        marker = "__space_end_%s__" % uuid.uuid4().hex
        script = []
        if self.identity != identity():  # see identity()
            script.append("RANDOM=%d" % int.from_bytes(os.urandom(2), "little"))
            self.identity = identity()
        for k, v in (env_vars or {}).items():
            script.append("__space_set_%s=${%s+x}; __space_old_%s=${%s-}; export %s=%s" % (k, k, k, k, k, shlex.quote(v)))
        script.append("source %s" % shlex.quote(path))
        for k in (env_vars or {}):
            script.append('if [ -n "$__space_set_%s" ]; then export %s="$__space_old_%s"; else unset %s; fi; unset __space_set_%s __space_old_%s'
                          % (k, k, k, k, k, k))
        script.append("rm -f %s; printf '%%s' %s; printf '%%s' %s >&2" % (shlex.quote(path), marker, marker))
        try:
            self._write("\n".join(script) + "\n")
        except OSError:
            ex.emit(error_line("UnexpectedEndOfExecution", "the shell is gone; the context was restarted"))
            self.restart()
            return
        mark = marker.encode()
        pending = {"stdout": b"", "stderr": b""}
        decoders = {n: codecs.getincrementaldecoder("utf-8")("replace") for n in pending}
        done = set()
        interrupted_at = None
        while len(done) < 2:
            if interrupted_at is None and ex.gone():
                self.interrupt()
                interrupted_at = time.time()
            if gen != self.generation:
                ex.emit(error_line("ContextRestarted", "the context was restarted during the execution"))
                return
            try:
                name, data = self.out.get(timeout=0.1)
            except queue.Empty:
                if interrupted_at is not None and time.time() - interrupted_at > INTERRUPT_GRACE:
                    self.restart()
                    return
                continue
            if data is None:  # the shell exited (exit in the code)
                ex.emit(error_line("UnexpectedEndOfExecution", "the shell exited; the context was restarted"))
                self.restart()
                return
            if name in done:
                continue
            buf = pending[name] + data
            i = buf.find(mark)
            if i >= 0:
                text, pending[name] = buf[:i], b""
                done.add(name)
            else:
                keep = len(mark) - 1
                text, pending[name] = buf[:-keep] if len(buf) > keep else b"", buf[-keep:] if len(buf) > keep else buf
            s = decoders[name].decode(text, final=name in done)
            if s:
                ex.emit({"type": name, "text": s})


FACTORIES = {"python": PythonContext, "bash": BashContext}


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.all = {}  # id -> context
        self.defaults = {}  # language -> context
        self.ready = threading.Event()

    def start_default(self):
        try:
            self.default("python")
            self.ready.set()
            log("default python context ready")
        except Exception as e:  # noqa: BLE001 - reported, the server stays up for /health
            log("default python context failed:", repr(e))

    @staticmethod
    def language(lang):
        lang = (lang or "python").strip().lower()
        if lang == "js":
            lang = "javascript"
        if lang not in LANGUAGES:
            raise BadRequest("language %r is not supported here (supported: %s)" % (lang, ", ".join(LANGUAGES)))
        return lang

    def create(self, lang, cwd):
        lang = self.language(lang)
        cwd = cwd or HOME
        if not os.path.isdir(cwd):
            raise BadRequest("cwd %s is not a directory" % cwd)
        ctx = FACTORIES[lang](cwd)
        ctx.start()
        with self.lock:
            self.all[ctx.id] = ctx
        log("context created", ctx.id, lang, cwd)
        return ctx

    def default(self, lang):
        lang = self.language(lang)
        with self.lock:
            ctx = self.defaults.get(lang)
        if ctx is not None:
            return ctx
        ctx = self.create(lang, HOME)
        with self.lock:
            if lang in self.defaults:  # created concurrently
                winner = self.defaults[lang]
            else:
                self.defaults[lang] = winner = ctx
        if winner is not ctx:
            self.remove(ctx.id)
        return winner

    def get(self, cid):
        with self.lock:
            ctx = self.all.get(cid)
        if ctx is None:
            raise ContextNotFound(cid)
        return ctx

    def list(self):
        with self.lock:
            return [{"id": c.id, "language": c.language, "cwd": c.cwd} for c in self.all.values()]

    def restart(self, cid):
        ctx = self.get(cid)
        ctx.interrupt()
        if ctx.lock.acquire(timeout=INTERRUPT_GRACE):
            try:
                ctx.restart()
            finally:
                ctx.lock.release()
        else:  # an execution does not let go: it sees the generation change and ends
            ctx.generation += 1
            ctx.restart()
        log("context restarted", cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.all.pop(cid, None)
            for lang, d in list(self.defaults.items()):
                if d is ctx:
                    del self.defaults[lang]
        if ctx is None:
            raise ContextNotFound(cid)
        ctx.generation += 1
        ctx.interrupt()
        ctx.shutdown()
        log("context removed", cid)


CONTEXTS = Contexts()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "space-codeinterp"

    def log_message(self, fmt, *args):
        pass

    # --- helpers ---

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n > 0 else b""
        if not raw.strip():
            return {}
        try:
            v = json.loads(raw)
        except ValueError as e:
            raise BadRequest("bad JSON body: %s" % e)
        if not isinstance(v, dict):
            raise BadRequest("the body must be a JSON object")
        return v

    def _send(self, status, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else (json.dumps(body) if ctype == "application/json" else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _text(self, status, msg):
        self._send(status, msg, "text/plain; charset=utf-8")

    def _route(self):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        try:
            if self.command == "GET" and path == "/health":
                if CONTEXTS.ready.is_set():
                    return self._send(200, "OK")
                return self._text(503, "starting")
            if self.command == "POST" and path == "/execute":
                return self._execute(self._body())
            if path == "/contexts":
                if self.command == "GET":
                    return self._send(200, CONTEXTS.list())
                if self.command == "POST":
                    body = self._body()
                    ctx = CONTEXTS.create(body.get("language"), body.get("cwd"))
                    return self._send(200, {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd})
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and self.command == "POST":
                CONTEXTS.restart(parts[1])
                return self._send(200, None)
            if len(parts) == 2 and parts[0] == "contexts" and self.command == "DELETE":
                CONTEXTS.remove(parts[1])
                return self._send(200, None)
            return self._text(404, "no route for %s %s" % (self.command, path))
        except ContextNotFound as e:
            return self._text(404, "Context %s not found" % e)
        except BadRequest as e:
            return self._text(400, str(e))
        except Exception as e:  # noqa: BLE001 - the client gets the reason
            log("request failed:", self.command, path, repr(e))
            return self._text(500, "%s: %s" % (type(e).__name__, e))

    do_GET = do_POST = do_DELETE = _route

    # --- execute ---

    def _execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code is required")
        cid, lang = body.get("context_id"), body.get("language")
        if cid and lang:
            raise BadRequest("give context_id or language, not both")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
            raise BadRequest("env_vars must map names to strings")
        ctx = CONTEXTS.get(cid) if cid else CONTEXTS.default(lang)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.flush()
        state = {"gone": False}

        def emit(obj):
            if state["gone"]:
                return
            line = (json.dumps(obj) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            except OSError:
                state["gone"] = True

        def gone():
            if state["gone"]:
                return True
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
                    state["gone"] = True
            except OSError:
                state["gone"] = True
            return state["gone"]

        ex = Execution(emit, gone)
        with ctx.lock:
            try:
                ctx.execute(code, env_vars, ex)
            except BadRequest as e:
                emit(error_line("BadRequest", str(e)))
            except Exception as e:  # noqa: BLE001 - reported in the stream
                log("execution failed:", repr(e))
                emit(error_line(type(e).__name__, str(e)))
        emit({"type": "end_of_execution"})
        if not state["gone"]:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
        else:
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return  # a client that went away
        log("request from", client_address, "failed:", repr(e))


def main():
    # Inherited by the kernels: debugpy (imported by ipykernel) warns about frozen
    # modules on every start otherwise; figures render inline.
    os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    srv = Server(("0.0.0.0", PORT), Handler)
    threading.Thread(target=CONTEXTS.start_default, daemon=True).start()
    log("code interpreter listening on port", PORT)
    srv.serve_forever()


if __name__ == "__main__":
    main()
