package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// Registry is a CNCF distribution registry (Debian's docker-registry) that a test
// started on 127.0.0.1, with its storage in a temporary directory.
type Registry struct {
	Addr    string // host:port
	Storage string // its filesystem storage root
}

// StartRegistry runs /usr/bin/docker-registry with a config written here; it is stopped
// when the test ends. Skips without the binary.
func StartRegistry(t testing.TB) *Registry {
	t.Helper()
	bin := RequireBinary(t, "docker-registry", "the Debian package docker-registry: scripts/setup.sh installs it")
	dir := t.TempDir()
	r := &Registry{Storage: filepath.Join(dir, "data")}
	secret := make([]byte, 16)
	rand.Read(secret)
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		r.Addr = freeAddr(t)
		cfg := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
  secret: %s
`, r.Storage, r.Addr, hex.EncodeToString(secret))
		cfgPath := filepath.Join(dir, "config.yml")
		if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		logf, err := os.Create(filepath.Join(dir, fmt.Sprintf("registry-%d.log", attempt)))
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin, "serve", cfgPath)
		cmd.Stdout, cmd.Stderr = logf, logf
		if err := cmd.Start(); err != nil {
			t.Fatalf("start docker-registry: %v", err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait(); logf.Close() }()
		if lastErr = waitRegistry(r.Addr, exited); lastErr == nil {
			t.Cleanup(func() {
				cmd.Process.Kill()
				<-exited
			})
			return r
		}
		cmd.Process.Kill()
		<-exited
		log, _ := os.ReadFile(logf.Name())
		lastErr = fmt.Errorf("%w: %s", lastErr, log)
	}
	t.Fatalf("docker-registry did not start: %v", lastErr)
	return nil
}

// waitRegistry waits until the registry answers /v2/ (or exits).
func waitRegistry(addr string, exited <-chan error) error {
	deadline := time.Now().Add(30 * time.Second)
	client := &http.Client{Timeout: time.Second}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for time.Now().Before(deadline) {
		resp, err := client.Get("http://" + addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case err := <-exited:
			return fmt.Errorf("docker-registry exited: %v", err)
		case <-tick.C:
		}
	}
	return fmt.Errorf("docker-registry on %s not ready after 30s", addr)
}

func freeAddr(t testing.TB) string { return FreeAddr(t) }
