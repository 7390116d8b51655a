/* libgone.so: a dependency of missing_dep.c that is absent at run time (it is built into a folder
 * that is on no search path and the plugin's RUNPATH does not name it). */
int rlh_test_gone_value(void);
int rlh_test_gone_value(void) { return 42; }
