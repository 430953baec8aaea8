// Package durable owns writes that must survive a host crash: each call returns only
// after the kernel has flushed what it wrote (fsync), so a snapshot or release that a
// caller reports done is on disk.
package durable

import (
	"fmt"
	"os"
)

// WriteFile writes data to path (created with perm, or truncated) and fsyncs it. The
// caller syncs the directory when the file is new and must survive too.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("fsync %s: %w", path, err)
	}
	return f.Close()
}

// Sync fsyncs the file or directory at path: for a directory, the names in it.
func Sync(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", path, err)
	}
	return nil
}
