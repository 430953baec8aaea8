package e2e

import (
	"os"
	"testing"

	"github.com/spacedev/space/api"
)

func TestZZScratch(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	out, errOut, code := s.exec(t, sb.ID, "sh", "-c", os.Getenv("SCRATCH_CMD"))
	t.Logf("code %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
}
