package conformance_test

import (
	"os/exec"
	"testing"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/conformance"
	"github.com/spacedev/space/internal/runtime/qemu"
)

func TestQEMU(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
	}
	if _, err := qemu.DefaultKernel(); err != nil {
		t.Skipf("no guest kernel: %v", err)
	}
	conformance.Run(t, conformance.Factory{
		New: func(t *testing.T, rootDir string) runtime.Runtime {
			rt, err := qemu.New(qemu.Config{RootDir: rootDir, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			return rt
		},
	})
}
