package qemu

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func TestSmoke(t *testing.T) {
	s := templatetest.Store(t)
	rel := templatetest.Base(t, s)
	ctx := context.Background()
	disk, err := s.CreateSandboxDisk(ctx, "smoke", rel.Digest, 0)
	if err != nil {
		t.Fatal(err)
	}
	agentBin := "/tmp/exp/bin/space-agent"
	rt, err := New(Config{RootDir: "/tmp/exp/qroot", Logger: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	state := t.TempDir()
	spec := runtime.Spec{ID: "smoke", RootFS: disk, StateDir: state, AgentPath: agentBin, CPU: 1, MemoryMB: 256}
	start := time.Now()
	if err := rt.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := rt.Destroy(ctx, "smoke"); err != nil {
			t.Error(err)
		}
		data, _ := os.ReadFile(filepath.Join(state, consoleLog))
		t.Logf("console:\n%s", data)
	}()
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) { return rt.Dial(ctx, "smoke") })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	h, err := c.WaitReady(wctx)
	if err != nil {
		data, _ := os.ReadFile(filepath.Join(state, consoleLog))
		ql, _ := os.ReadFile(filepath.Join(state, qemuLog))
		ents, _ := os.ReadDir(state)
		t.Fatalf("%v\nconsole:\n%s\nqemu:\n%s\n%v", err, data, ql, ents)
	}
	t.Logf("ready after %v: %+v", time.Since(start), h)
	pi, err := c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"python3", "-c", "print(6*7)"}})
	if err != nil {
		t.Fatal(err)
	}
	out, err := c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	for {
		f, err := out.Next()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("frame %d %q", f.Type, f.Payload)
		if f.Type == wire.FrameExit {
			break
		}
	}
	out.Close()
	data, _ := os.ReadFile(filepath.Join(state, consoleLog))
	t.Logf("console before destroy:\n%s", data)
}
