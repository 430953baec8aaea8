package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"
)

// The sandbox's stdio (the agent's log, and anything sandbox code writes to the agent's
// stdout or stderr) and the output of `runsc run` and `runsc restore` go to
// <StateDir>/log/runsc.log. runsc hands the file to the Sentry, which writes to it
// directly, so no process of ours sits in between to bound it: the file lives on a tmpfs
// of logTmpfsSize (writes beyond fail, and are lost), and the runtime rotates it in the
// background: once it exceeds logRotateSize, its last logKeepSize bytes move to
// runsc.log.1 and it is truncated (the writer appends, so it continues at the start).
// Lines written during a rotation may be lost; that is the price of a writer we cannot
// pause.
const (
	logFile        = "runsc.log"
	logFileOld     = "runsc.log.1"
	logRotateSize  = 1 << 20
	logKeepSize    = 256 << 10
	logRotateEvery = 5 * time.Second
)

// logPath is the instance's current log file.
func logPath(stateDir string) string { return filepath.Join(stateDir, logDir, logFile) }

// rotateLogs rotates the log of every instance with a record, every logRotateEvery,
// until ctx ends.
func (r *Runtime) rotateLogs(ctx context.Context) {
	tick := time.NewTicker(logRotateEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		ids, err := r.recordIDs()
		if err != nil {
			r.log.WarnContext(ctx, "log rotation: list instances", "err", err)
			continue
		}
		for _, id := range ids {
			rec, err := r.readRecord(id)
			if err != nil {
				continue // destroyed meanwhile
			}
			if err := rotateLog(filepath.Join(rec.StateDir, logDir), logRotateSize, logKeepSize); err != nil {
				r.log.WarnContext(ctx, "log rotation", "id", id, "err", err)
			}
		}
	}
}

// rotateLog rotates dir/runsc.log when it is larger than limit: its last keep bytes
// replace dir/runsc.log.1, and it is truncated. The log is truncated before the copy is
// written, so that the copy fits on a full tmpfs.
func rotateLog(dir string, limit, keep int64) error {
	cur := filepath.Join(dir, logFile)
	f, err := os.OpenFile(cur, os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() <= limit {
		return nil
	}
	tail := make([]byte, min(keep, fi.Size()))
	if _, err := f.ReadAt(tail, fi.Size()-int64(len(tail))); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("read %s: %w", cur, err)
	}
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("truncate %s: %w", cur, err)
	}
	old := filepath.Join(dir, logFileOld)
	if err := os.Remove(old); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.WriteFile(old, tail, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", old, err)
	}
	return nil
}
