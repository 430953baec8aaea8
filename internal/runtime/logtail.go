package runtime

import (
	"io"
	"os"
	"strings"
)

// LogTail returns the last n bytes of the log file at path, trimmed: what a runtime
// quotes from its VMM's or runsc's log when a start fails. Best effort: "" when the
// file cannot be read.
func LogTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		if _, err := f.Seek(-n, io.SeekEnd); err != nil {
			return ""
		}
	}
	b, _ := io.ReadAll(io.LimitReader(f, n))
	return strings.TrimSpace(string(b))
}
