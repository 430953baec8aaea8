package e2e

import (
	"os"
	"testing"
	"time"
)

// Temporary development helper (not to be committed).
func TestZZDevE2BServer(t *testing.T) {
	if os.Getenv("E2B_DEV") == "" {
		t.Skip()
	}
	s := start(t, options{args: []string{"--e2b-listen", "127.0.0.1:3390"}})
	out, _, _ := s.cli(t, "apikey", "create", "dev", "--e2b")
	os.WriteFile("/tmp/e2bdev.env", []byte("E2B_API_KEY="+out+"SPACE_URL="+s.URL+"\nSPACE_DATA_DIR="+s.dataDir+"\n"), 0o644)
	os.WriteFile("/tmp/e2bdev.run", nil, 0o644)
	for {
		if _, err := os.Stat("/tmp/e2bdev.run"); err != nil {
			return
		}
		time.Sleep(time.Second)
		if t.Failed() {
			return
		}
	}
}

func (s *srv) devLog() string { return s.Log() }
