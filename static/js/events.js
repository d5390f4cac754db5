/* A minimal synchronous event emitter: the seam through which a module tells the modules above it that its
 * state changed, without importing them (the import graph stays one-way; see static/README.md). */

export function createEmitter() {
  const handlers = new Map();   // event name -> listeners, called in the order they subscribed
  return {
    on(type, fn) {
      if (!handlers.has(type)) handlers.set(type, []);
      handlers.get(type).push(fn);
      return () => { const list = handlers.get(type); list.splice(list.indexOf(fn), 1); };
    },
    emit(type, ...args) {
      for (const fn of [...(handlers.get(type) || [])]) fn(...args);
    },
  };
}
