// Command testagent is a stand-in for space-agent used by the gVisor runtime tests. It
// serves on $SPACE_AGENT_LISTEN — connect:PATH (it connects to the node's socket, as
// space-agent does, through package agentlink) or unix:PATH (it listens) — and
// answers a few inspection endpoints so tests can look inside the sandbox. Besides
// agentlink it depends on the standard library only.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/spacedev/space/internal/guest/agentlink"
)

// held is the memory POST /hold keeps.
var (
	heldMu sync.Mutex
	held   [][]byte
)

func main() {
	if len(os.Args) > 2 && os.Args[1] == "bomb" {
		// Join the cgroup first (the way space-agent starts user processes), then bomb.
		if cg := os.Args[2]; cg != "" {
			if err := os.WriteFile(cg+"/cgroup.procs", []byte("0"), 0); err != nil {
				fmt.Fprintln(os.Stderr, "bomb: join cgroup:", err)
				os.Exit(1)
			}
		}
		bomb()
		return
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "testagent:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := os.Getenv("SPACE_AGENT_LISTEN")
	path, ok := strings.CutPrefix(listen, "unix:")
	connect := false
	if !ok {
		if path, ok = strings.CutPrefix(listen, "connect:"); !ok {
			return fmt.Errorf("SPACE_AGENT_LISTEN=%q: want unix:PATH or connect:PATH", listen)
		}
		connect = true
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, map[string]string{"version": "test"})
	})
	mux.HandleFunc("POST /spin", func(w http.ResponseWriter, r *http.Request) {
		// Burn CPU for ?ms= milliseconds of wall time (CPU accounting tests).
		ms, _ := strconv.Atoi(r.URL.Query().Get("ms"))
		n := 0
		for end := time.Now().Add(time.Duration(ms) * time.Millisecond); time.Now().Before(end); {
			for i := 0; i < 100000; i++ {
				n += i
			}
		}
		writeJSON(w, map[string]int{"n": n})
	})
	mux.HandleFunc("GET /meminfo", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile("/proc/meminfo")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	mux.HandleFunc("GET /netdevs", func(w http.ResponseWriter, r *http.Request) {
		ifs, err := net.Interfaces()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		names := []string{}
		for _, i := range ifs {
			names = append(names, i.Name)
		}
		writeJSON(w, names)
	})
	mux.HandleFunc("GET /env", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, os.Environ())
	})
	mux.HandleFunc("GET /mounts", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile("/proc/self/mounts")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile("/proc/self/status")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	// POST /hold?mib=N allocates N MiB, writes every page and keeps it (guest memory a
	// checkpoint saves and a restore loads).
	mux.HandleFunc("POST /hold", func(w http.ResponseWriter, r *http.Request) {
		mib, err := strconv.Atoi(r.URL.Query().Get("mib"))
		if err != nil || mib <= 0 {
			http.Error(w, "mib", http.StatusBadRequest)
			return
		}
		b := make([]byte, mib<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		heldMu.Lock()
		held = append(held, b)
		heldMu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	// GET /read?path=P returns the file P (inside the sandbox).
	mux.HandleFunc("GET /read", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile(r.URL.Query().Get("path"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	// POST /mkdir?path=P makes directory P (inside the sandbox).
	mux.HandleFunc("POST /mkdir", func(w http.ResponseWriter, r *http.Request) {
		if err := os.Mkdir(r.URL.Query().Get("path"), 0o755); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	// POST /write?path=P writes the request body to P (inside the sandbox).
	mux.HandleFunc("POST /write", func(w http.ResponseWriter, r *http.Request) {
		f, err := os.Create(r.URL.Query().Get("path"))
		if err == nil {
			_, err = f.ReadFrom(r.Body)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	var bombMu sync.Mutex
	bombPgid := 0
	// POST /forkbomb starts a fork bomb: copies of this program that each start copies
	// of themselves as fast as they can, in one process group.
	mux.HandleFunc("POST /forkbomb", func(w http.ResponseWriter, r *http.Request) {
		bombMu.Lock()
		defer bombMu.Unlock()
		cmd := exec.Command("/proc/self/exe", "bomb", r.URL.Query().Get("cgroup"))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		bombPgid = cmd.Process.Pid
		go reapAll() // PID 1 inherits the orphans
		writeJSON(w, bombPgid)
	})
	// POST /forkbomb/stop kills the bomb's process group until no member is left.
	mux.HandleFunc("POST /forkbomb/stop", func(w http.ResponseWriter, r *http.Request) {
		bombMu.Lock()
		defer bombMu.Unlock()
		deadline := time.Now().Add(30 * time.Second)
		for rounds := 1; ; rounds++ {
			err := syscall.Kill(-bombPgid, syscall.SIGKILL)
			if errors.Is(err, syscall.ESRCH) {
				writeJSON(w, rounds)
				return
			}
			if err != nil || time.Now().After(deadline) {
				http.Error(w, fmt.Sprintf("kill bomb after %d rounds: %v", rounds, err), http.StatusInternalServerError)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	// GET /procs counts the sandbox's processes.
	mux.HandleFunc("GET /procs", func(w http.ResponseWriter, r *http.Request) {
		entries, err := os.ReadDir("/proc")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		n := 0
		for _, e := range entries {
			if _, err := strconv.Atoi(e.Name()); err == nil {
				n++
			}
		}
		writeJSON(w, n)
	})
	// GET /statx?path=P calls statx(2) with AT_NO_AUTOMOUNT, as GNU coreutils 9 does
	// (old gVisor releases rejected the flag with EINVAL).
	mux.HandleFunc("GET /statx", func(w http.ResponseWriter, r *http.Request) {
		p, err := syscall.BytePtrFromString(r.URL.Query().Get("path"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		const atFDCWD, atNoAutomount, statxBasicStats = -100, 0x800, 0x7ff
		var buf [256]byte
		fd := atFDCWD
		_, _, errno := syscall.Syscall6(332 /* SYS_STATX on amd64 */, uintptr(fd), uintptr(unsafe.Pointer(p)), atNoAutomount, statxBasicStats, uintptr(unsafe.Pointer(&buf[0])), 0)
		if errno != 0 {
			http.Error(w, errno.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	// POST /stderr?n=N writes N bytes of log lines to the agent's stderr (its log).
	mux.HandleFunc("POST /stderr", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.URL.Query().Get("n"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		line := []byte(strings.Repeat("x", 99) + "\n")
		written := 0
		for written < n {
			k, err := os.Stderr.Write(line)
			written += k
			if err != nil {
				break // the log is full: the agent goes on
			}
		}
		writeJSON(w, written)
	})
	// POST /quiesce answers, then closes the listener (runsc cannot checkpoint a bound
	// host socket) and waits for a file "resume" in the socket's directory to listen
	// again, like space-agent.
	quiesce := make(chan struct{}, 1)
	mux.HandleFunc("POST /quiesce", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
		// Out before the listener closes.
		_ = http.NewResponseController(w).Flush()
		quiesce <- struct{}{}
	})
	dir := path[:strings.LastIndex(path, "/")]
	var key agentlink.Key // kept across quiesces, as space-agent keeps its own
	for {
		var l net.Listener
		var err error
		if connect {
			// As space-agent: retried until the node listens (it may be restarting).
			for {
				if l, err = agentlink.Listen(context.Background(), path, &key); err == nil {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
		} else {
			_ = os.Remove(path)
			l, err = net.Listen("unix", path)
		}
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: mux}
		go srv.Serve(l)
		<-quiesce
		// Shutdown lets the quiesce answer go out, then closes every connection.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = srv.Shutdown(ctx)
		cancel()
		if err != nil {
			return err
		}
		if err := os.WriteFile(dir+"/quiesced", nil, 0o600); err != nil {
			return err
		}
		for {
			if _, err := os.Stat(dir + "/resume"); err == nil {
				break
			}
			time.Sleep(5 * time.Millisecond) // poll interval
		}
		_ = os.Remove(dir + "/resume")
		_ = os.Remove(dir + "/quiesced")
	}
}

// bomb starts copies of itself without end; failures (the pids limit) only slow it.
func bomb() {
	for {
		cmd := exec.Command("/proc/self/exe", "bomb", "")
		if err := cmd.Start(); err != nil {
			time.Sleep(time.Millisecond)
			continue
		}
		go cmd.Wait()
	}
}

// reapAll waits for any child until there is none left.
func reapAll() {
	for {
		var ws syscall.WaitStatus
		if _, err := syscall.Wait4(-1, &ws, 0, nil); errors.Is(err, syscall.ECHILD) {
			return
		}
	}
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}
