package conformance_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/conformance"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

func TestGVisor(t *testing.T) {
	if _, err := os.Stat(gvisor.DefaultRunscPath); err != nil {
		t.Skipf("runsc not installed at %s (scripts/setup.sh builds it)", gvisor.DefaultRunscPath)
	}
	conformance.Run(t, conformance.Factory{
		New: func(t *testing.T, rootDir string) runtime.Runtime {
			// The sandboxes' user namespace must search the way to the runtime's id-mapped
			// views; t.TempDir makes its directories 0700.
			for _, d := range []string{rootDir, filepath.Dir(rootDir)} {
				if err := os.Chmod(d, 0o711); err != nil {
					t.Fatal(err)
				}
			}
			rt, err := gvisor.New(gvisor.Config{RootDir: rootDir, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			// runsc pins an empty network namespace for its gofers in its root dir (a
			// mount): release it so that the test's root dir can be removed.
			t.Cleanup(func() {
				if err := gvisor.UnpinNullNetNS(rootDir); err != nil {
					t.Error(err)
				}
			})
			return rt
		},
		CPUIsQuota: true,
	})
}
