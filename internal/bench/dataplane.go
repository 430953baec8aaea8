package bench

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

// runscRoot is where the local server's runsc keeps its state (see cmd/space).
func runscRoot(dataDir string) string {
	abs, _ := filepath.Abs(dataDir)
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join("/run/space", "runsc-"+hex.EncodeToString(sum[:6]))
}

// sandbox creates a sandbox for a scenario and returns it with a cleanup.
func sandbox(ctx context.Context, cfg *Config, req api.CreateSandboxRequest) (*api.Sandbox, func(), error) {
	if req.Template == "" {
		req.Template = cfg.Template
	}
	if req.Metadata == nil {
		req.Metadata = map[string]string{"space-bench": "1"}
	}
	sb, err := cfg.Client.CreateAndWait(ctx, req)
	if err != nil {
		return nil, nil, err
	}
	return sb, func() { _ = deleteAndWait(context.WithoutCancel(ctx), cfg.Client, sb.ID) }, nil
}

// execRoundTrip measures a command round trip of `true` both ways — one request
// (POST /v1/sandboxes/{id}/exec) and a session + attach — against `runsc exec true` in
// the same sandbox, interleaved so all three see the same load.
func execRoundTrip(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	var xs, ss, bs []float64
	for i := 0; i < cfg.Runs; i++ {
		// One request (POST /v1/sandboxes/{id}/exec), what client.Exec and space exec use.
		start := time.Now()
		x, err := cfg.Client.Run(ctx, sb.ID, api.ExecRequest{Argv: []string{"true"}}, client.Output{})
		if err != nil || client.ExitCode(x) != 0 {
			return nil, fmt.Errorf("exec true: %+v %v", x, err)
		}
		xs = append(xs, ms(time.Since(start)))
		// The two-step path: a command session, then its attach stream.
		start = time.Now()
		sess, err := cfg.Client.CreateSession(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"true"}})
		if err == nil {
			x, err = cfg.Client.Follow(ctx, sess, client.Output{})
		}
		if err != nil || client.ExitCode(x) != 0 {
			return nil, fmt.Errorf("session true: %+v %v", x, err)
		}
		ss = append(ss, ms(time.Since(start)))
		start = time.Now()
		if out, err := exec.CommandContext(ctx, gvisor.DefaultRunscPath, "--root", runscRoot(cfg.DataDir), "exec", sb.ID, "/bin/true").CombinedOutput(); err != nil {
			return nil, fmt.Errorf("runsc exec: %v: %s", err, out)
		}
		bs = append(bs, ms(time.Since(start)))
	}
	return []Result{
		result("exec", "POST …/exec → exit of `true` (one request)", "ms", xs, "runsc exec true", bs),
		result("exec", "session + attach + exit of `true`", "ms", ss, "runsc exec true", bs),
	}, nil
}

// countingWriter counts bytes.
type countingWriter struct{ n int64 }

func (c *countingWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

// throughput streams 1 GiB of output to one reader (client.Exec: the exec route in the
// frames encoding), against runsc exec of the same
// command with its output going to /dev/null on the host.
func throughput(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	const size = 1 << 30
	runs := min(cfg.Runs, 5)
	var xs, bs, hs []float64
	var droppedTotal int64
	// runsc exec of the same command, its stdout given as is: a file (/dev/null,
	// handed to runsc) or a writer (a pipe this process drains).
	runscHead := func(stdout io.Writer) (float64, error) {
		start := time.Now()
		cmd := exec.CommandContext(ctx, gvisor.DefaultRunscPath, "--root", runscRoot(cfg.DataDir), "exec", sb.ID, "head", "-c", "1G", "/dev/zero")
		cmd.Stdout = stdout
		err := cmd.Run()
		return float64(size) / (1 << 20) / time.Since(start).Seconds(), err
	}
	for i := 0; i < runs; i++ {
		var w countingWriter
		var dropped int64
		start := time.Now()
		code, err := cfg.Client.Exec(ctx, sb.ID, api.CreateSessionRequest{Command: "head -c 1G /dev/zero"},
			client.Output{Stdout: &w, OnGap: func(g api.GapEvent) { dropped += g.Dropped }})
		if err != nil || code != 0 || w.n+dropped != size {
			return nil, fmt.Errorf("stream 1 GiB: %d bytes received, %d dropped, exit %d, %v", w.n, dropped, code, err)
		}
		// What the reader received per second is the stream's throughput: the writer
		// waits for a reader that keeps up, and bytes a stalled reader missed (gaps)
		// do not count.
		xs = append(xs, float64(w.n)/(1<<20)/time.Since(start).Seconds())
		droppedTotal += dropped
		devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		if err != nil {
			return nil, err
		}
		rate, err := runscHead(devnull)
		devnull.Close()
		if err != nil {
			return nil, fmt.Errorf("runsc exec head: %w", err)
		}
		bs = append(bs, rate)
		// The same with a reader: /dev/null takes the bytes without copying them; any
		// reader, here or through space, has them copied at least once.
		var hw countingWriter
		if rate, err = runscHead(&hw); err != nil || hw.n != size {
			return nil, fmt.Errorf("runsc exec head | reader: %d bytes, %v", hw.n, err)
		}
		hs = append(hs, rate)
	}
	r := result("throughput", "1 GiB of stdout to one reader (frames)", "MiB/s", xs, "runsc exec > /dev/null", bs)
	r.Note = fmt.Sprintf("MiB/s received by the reader, client.Exec in the frames encoding (ratio = space / runsc, higher is better); %d MiB fell out of the journal unread over %d runs", droppedTotal>>20, runs)
	h := result("throughput", "1 GiB of stdout to one reader (frames), against a reader on the host", "MiB/s", xs, "runsc exec | reader", hs)
	h.Note = "the same streams against runsc exec's stdout read through a pipe by a reader on the host (Go's os/exec copy), the bare runtime's own way to hand output to a program"
	return []Result{r, h}, nil
}

// files measures a 256 MiB upload and download.
func files(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	const size = 256 << 20
	runs := min(cfg.Runs, 10)
	var up, down []float64
	for i := 0; i < runs; i++ {
		start := time.Now()
		if _, err := cfg.Client.WriteFile(ctx, sb.ID, "/root/bench.bin", io.LimitReader(zeros{}, size), client.FileOptions{}); err != nil {
			return nil, err
		}
		up = append(up, float64(size)/(1<<20)/time.Since(start).Seconds())
		start = time.Now()
		rc, err := cfg.Client.ReadFile(ctx, sb.ID, "/root/bench.bin", client.FileOptions{})
		if err != nil {
			return nil, err
		}
		n, err := io.Copy(io.Discard, rc)
		rc.Close()
		if err != nil || n != size {
			return nil, fmt.Errorf("download: %d bytes, %v", n, err)
		}
		down = append(down, float64(size)/(1<<20)/time.Since(start).Seconds())
	}
	return []Result{
		result("files", "256 MiB upload", "MiB/s", up, "", nil),
		result("files", "256 MiB download", "MiB/s", down, "", nil),
	}, nil
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// serverRSS reads the server's resident memory from its /metrics.
func serverRSS(ctx context.Context, c *client.Client) (float64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+c.APIKey) // metrics need an operator key
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "process_resident_memory_bytes "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	return 0, fmt.Errorf("no process_resident_memory_bytes in /metrics")
}

// agentRSS reads the agent's (PID 1's) resident memory inside a sandbox.
func agentRSS(ctx context.Context, c *client.Client, id string) (float64, error) {
	var out strings.Builder
	if _, err := c.Exec(ctx, id, api.CreateSessionRequest{Argv: []string{"ps", "-o", "rss=", "-p", "1"}}, client.Output{Stdout: &out}); err != nil {
		return 0, err
	}
	kb, err := strconv.ParseFloat(strings.TrimSpace(out.String()), 64)
	return kb * 1024, err
}

// memory measures the server's and the agent's RSS while 2 GiB stream to a slow reader.
func memory(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{MemoryMB: 1024})
	if err != nil {
		return nil, err
	}
	defer done()
	sess, err := cfg.Client.CreateSession(ctx, sb.ID, api.CreateSessionRequest{Command: "head -c 2G /dev/zero"})
	if err != nil {
		return nil, err
	}
	st, err := cfg.Client.Attach(ctx, sess, "")
	if err != nil {
		return nil, err
	}
	defer st.Close()
	finished := make(chan struct{})
	go func() { // the slow reader: one event every 20 ms
		defer close(finished)
		for {
			ev, err := st.Next()
			if err != nil || ev.Name == api.EventExit {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	var srv, agent []float64
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		if v, err := serverRSS(ctx, cfg.Client); err == nil {
			srv = append(srv, v/(1<<20))
		}
		if v, err := agentRSS(ctx, cfg.Client, sb.ID); err == nil {
			agent = append(agent, v/(1<<20))
		}
		p, err := cfg.Client.GetProcess(ctx, sb.ID, sess.PID)
		if err == nil && p.State == api.ProcExited {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	st.Close()
	<-finished
	rs := result("memory", "space serve RSS, 2 GiB to a slow reader", "MiB", srv, "", nil)
	ra := result("memory", "agent RSS, 2 GiB to a slow reader", "MiB", agent, "", nil)
	rs.Note, ra.Note = "median and p95 of samples every 0.5 s", "median and p95 of samples every 0.5 s"
	return []Result{rs, ra}, nil
}
