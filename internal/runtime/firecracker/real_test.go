package firecracker

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/conformance"
)

// TestRealFirecracker runs the runtime conformance suite against real Firecracker. It
// needs a KVM host (vmx/svm and /dev/kvm) and, from the environment:
//
//	SPACE_FIRECRACKER_BIN      the firecracker binary (required)
//	SPACE_JAILER_BIN           the jailer of the same release (default: "jailer" beside
//	                           firecracker, else on PATH)
//	SPACE_FIRECRACKER_KERNEL   an uncompressed guest vmlinux (required; named
//	                           vmlinux-<version> to pick up /lib/modules/<version>)
//	SPACE_FIRECRACKER_MODULES  the kernel's modules directory (optional)
//	SPACE_FIRECRACKER_UID/GID  the jailer user (default 65534, nobody/nogroup)
//
// Without them it skips, naming what is missing.
func TestRealFirecracker(t *testing.T) {
	var missing []string
	bin := os.Getenv("SPACE_FIRECRACKER_BIN")
	if bin == "" {
		missing = append(missing, "SPACE_FIRECRACKER_BIN (a firecracker binary)")
	}
	jailer := os.Getenv("SPACE_JAILER_BIN")
	if jailer == "" && bin != "" {
		if p := filepath.Join(filepath.Dir(bin), "jailer"); fileExists(p) {
			jailer = p
		} else if p, err := exec.LookPath("jailer"); err == nil {
			jailer = p
		} else {
			missing = append(missing, "the jailer (SPACE_JAILER_BIN, or jailer beside firecracker or on PATH)")
		}
	}
	kernel := os.Getenv("SPACE_FIRECRACKER_KERNEL")
	if kernel == "" {
		missing = append(missing, "SPACE_FIRECRACKER_KERNEL (an uncompressed vmlinux)")
	}
	if err := CheckKVM(); err != nil {
		missing = append(missing, "hardware KVM: "+err.Error())
	}
	if os.Geteuid() != 0 {
		missing = append(missing, "root (the jailer needs it)")
	}
	if len(missing) > 0 {
		t.Skip("real Firecracker not available; missing: " + strings.Join(missing, "; "))
	}
	uid, gid := envInt(t, "SPACE_FIRECRACKER_UID", 65534), envInt(t, "SPACE_FIRECRACKER_GID", 65534)
	conformance.Run(t, conformance.Factory{
		New: func(t *testing.T, rootDir string) runtime.Runtime {
			rt, err := New(Config{
				FirecrackerPath: bin, JailerPath: jailer, KernelPath: kernel,
				ModulesDir: os.Getenv("SPACE_FIRECRACKER_MODULES"),
				RootDir:    rootDir, UID: uid, GID: gid, Logger: testLogger(t),
			})
			if err != nil {
				t.Fatal(err)
			}
			return rt
		},
	})
}

func envInt(t *testing.T, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return n
}
