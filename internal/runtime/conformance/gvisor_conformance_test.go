package conformance_test

import (
	"os/exec"
	"testing"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/conformance"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

func TestGVisor(t *testing.T) {
	if _, err := exec.LookPath("runsc"); err != nil {
		t.Skip("runsc not found (apt-get install runsc)")
	}
	conformance.Run(t, conformance.Factory{
		New: func(t *testing.T, rootDir string) runtime.Runtime {
			rt, err := gvisor.New(gvisor.Config{RootDir: rootDir, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			return rt
		},
		CPUIsQuota: true,
	})
}
